//! What the planner observes between two adjustments: requests as they are routed and
//! answers as they end (fed by the request path), and the pools' load sampled every metric
//! interval.
//!
//! Request figures are kept per model and per pool role, so that a prefill pool and a decode
//! pool of one model each see their own part of its traffic (see [`Window::routed`] and
//! [`Window::answered`] for what goes where). The request path pays one short lock per
//! request and per ended answer, and only on a gateway with a planner. [`Window::close`] turns
//! what was gathered into one interval's [`IntervalStats`] per pool and starts the next
//! interval empty.

use std::collections::HashMap;
use std::time::Instant;

use parking_lot::Mutex;

use crate::config::Role;
use crate::policy::planning::{IntervalStats, PoolRole};

/// Answers' latencies kept per model, pool role and interval (enough for a stable p90; beyond
/// it, a reservoir keeps an even sample).
const MAX_LATENCIES: usize = 4096;

/// What arrived and ended for one model at the pools of one role.
#[derive(Debug, Default)]
struct Requests {
    arrivals: u64,
    prompt_tokens: u64,
    ended: u64,
    output_tokens: u64,
    ttft_ms: Vec<f32>,
    itl_ms: Vec<f32>,
    /// For the reservoir: answers seen past [`MAX_LATENCIES`].
    seen: u64,
}

/// [`Requests`] of one model, one per pool role (see [`slot`]).
type ByRole = [Requests; 4];

/// The index of `role`'s [`Requests`] in a [`ByRole`].
fn slot(role: PoolRole) -> usize {
    match role {
        PoolRole::Aggregated => 0,
        PoolRole::Prefill => 1,
        PoolRole::Decode => 2,
        PoolRole::Encoder => 3,
    }
}

/// The role of the pool a worker of `role` belongs to: `llm` workers to aggregated pools,
/// `prefill` and `decode` workers to pools of their own role, encoders to encoder pools.
pub fn pool_role_of(role: Role) -> PoolRole {
    match role {
        Role::Llm => PoolRole::Aggregated,
        Role::Prefill => PoolRole::Prefill,
        Role::Decode => PoolRole::Decode,
        Role::Vision | Role::Audio => PoolRole::Encoder,
    }
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
    requests: Mutex<HashMap<String, ByRole>>,
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
    /// Runs `f` on `model`'s figures for pools of `role`.
    fn with(&self, model: &str, role: PoolRole, f: impl FnOnce(&mut Requests)) {
        let mut requests = self.requests.lock();
        // Looked up by `&str` first: the model's entry exists after its first request, and
        // the request path should not allocate its name each time.
        let by_role = match requests.get_mut(model) {
            Some(by_role) => by_role,
            None => requests.entry(model.to_string()).or_default(),
        };
        f(&mut by_role[slot(role)]);
    }

    /// A request for `model` with `prompt_tokens` reached the pools of `role`.
    pub fn arrived(&self, model: &str, role: PoolRole, prompt_tokens: u64) {
        self.with(model, role, |entry| {
            entry.arrivals += 1;
            entry.prompt_tokens += prompt_tokens;
        });
    }

    /// An answer for `model` ended, counted for the pools of `role`: its time to first token,
    /// mean gap between chunks (streams of two chunks or more) and generated tokens.
    pub fn ended(&self, model: &str, role: PoolRole, ttft_ms: f64, itl_ms: Option<f64>, output_tokens: u64) {
        self.with(model, role, |entry| {
            entry.ended += 1;
            entry.output_tokens += output_tokens;
            entry.seen += 1;
            let seen = entry.seen;
            keep(&mut entry.ttft_ms, ttft_ms as f32, seen);
            if let Some(itl) = itl_ms {
                keep(&mut entry.itl_ms, itl as f32, seen);
            }
        });
    }

    /// A request for `model` with `prompt_tokens` was routed: it arrives at the pool of its
    /// answering worker (role `answering`: an aggregated pool for an `llm` worker, a decode
    /// pool for a `decode` one) and, when the router sent its prompt to a prefill worker
    /// first (`prefill`), at the model's prefill pool as well.
    pub fn routed(&self, model: &str, answering: Role, prefill: bool, prompt_tokens: u64) {
        self.arrived(model, pool_role_of(answering), prompt_tokens);
        if prefill {
            self.arrived(model, PoolRole::Prefill, prompt_tokens);
        }
    }

    /// A request for `model` found no worker to route to: demand on the model's answering
    /// pools (aggregated and decode), which must grow to meet it (a pool at zero workers
    /// would otherwise never see any).
    pub fn unrouted(&self, model: &str, prompt_tokens: u64) {
        self.arrived(model, PoolRole::Aggregated, prompt_tokens);
        self.arrived(model, PoolRole::Decode, prompt_tokens);
    }

    /// An answer for `model` ended: its TTFT, ITL and generated tokens count for the pool of
    /// its answering worker (role `answering`); when a prefill worker computed its prompt
    /// (`prefilled_remotely`), its TTFT and generated tokens count for the model's prefill
    /// pool too (the TTFT its prefill made; a prefill pool has no ITL of its own).
    pub fn answered(
        &self,
        model: &str,
        answering: Role,
        prefilled_remotely: bool,
        ttft_ms: f64,
        itl_ms: Option<f64>,
        output_tokens: u64,
    ) {
        self.ended(model, pool_role_of(answering), ttft_ms, itl_ms, output_tokens);
        if prefilled_remotely {
            self.ended(model, PoolRole::Prefill, ttft_ms, None, output_tokens);
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

    /// Ends the interval: each pool's stats (pools by index, as their model and role), and a
    /// fresh interval begins. Two pools of the same model and role would share its figures
    /// (the configuration refuses them).
    pub fn close(&self, pools: &[(&str, PoolRole)]) -> Vec<IntervalStats> {
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
            .map(|(index, (model, role))| {
                let load = samples.get(&index).copied().unwrap_or_default();
                let count = f64::from(load.count.max(1));
                let mut empty = Requests::default();
                let seen = requests
                    .get_mut(*model)
                    .map_or(&mut empty, |by_role| &mut by_role[slot(*role)]);
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
            window.routed("m", Role::Llm, false, 100 * (i + 1));
            window.answered("m", Role::Llm, false, f64::from(i as u32 * 10), Some(5.0), 20);
        }
        window.routed("other", Role::Llm, false, 7);
        window.sample(0, 0.5, 1000.0);
        window.sample(0, 0.7, 3000.0);
        let stats = window.close(&[("m", PoolRole::Aggregated), ("nobody", PoolRole::Aggregated)]);
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
        let next = window.close(&[("m", PoolRole::Aggregated)]);
        assert_eq!(next[0].mean_isl, 0.0, "the next interval starts empty");
    }

    #[test]
    fn prefill_and_decode_pools_of_one_model_see_their_own_requests() {
        let window = Window::default();
        // Two long prompts computed on prefill workers and answered by decode workers, one
        // short prompt a decode worker prefilled itself, one request on an `llm` worker.
        for (prompt, ttft) in [(4000, 300.0), (6000, 500.0)] {
            window.routed("m", Role::Decode, true, prompt);
            window.answered("m", Role::Decode, true, ttft, Some(20.0), 10);
        }
        window.routed("m", Role::Decode, false, 100);
        window.answered("m", Role::Decode, false, 50.0, Some(40.0), 50);
        window.routed("m", Role::Llm, false, 900);
        window.answered("m", Role::Llm, false, 70.0, Some(8.0), 30);
        // No worker at all: demand on the answering pools.
        window.unrouted("m", 2000);
        let pools = [
            ("m", PoolRole::Prefill),
            ("m", PoolRole::Decode),
            ("m", PoolRole::Aggregated),
            ("m", PoolRole::Encoder),
        ];
        let [prefill, decode, aggregated, encoder] = window.close(&pools)[..] else {
            panic!("one interval per pool");
        };
        assert_eq!(prefill.mean_isl, 5000.0, "the prompts it computed");
        assert_eq!(prefill.ttft_p90_ms, 500.0);
        assert_eq!(prefill.itl_p90_ms, 0.0, "a prefill pool has no ITL of its own");
        assert_eq!(decode.mean_isl, (4000.0 + 6000.0 + 100.0 + 2000.0) / 4.0);
        assert_eq!(decode.itl_p90_ms, 40.0, "the streams its workers served");
        assert!((decode.mean_osl - 70.0 / 3.0).abs() < 1e-4);
        assert_eq!(aggregated.mean_isl, (900.0 + 2000.0) / 2.0);
        assert_eq!(aggregated.itl_p90_ms, 8.0);
        assert!(
            (decode.request_rate / prefill.request_rate - 2.0).abs() < 1e-3,
            "4 requests reached the decode pool, 2 the prefill pool"
        );
        assert_eq!(encoder.request_rate, 0.0);
    }
}
