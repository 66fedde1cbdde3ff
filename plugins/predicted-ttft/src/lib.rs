//! `predicted-ttft`: the worker with the lowest predicted cost in milliseconds, from the same
//! performance model the engines follow.
//!
//! Why: `kv-aware` counts blocks. A block of queued prefill and a block held by a decoding
//! sequence cost it the same, so it cannot tell a worker with a long prefill queue (every new
//! request waits for all of it) from one with many cheap decoders (a new request shares the next
//! step with them). This policy instead predicts the time to first token in milliseconds with
//! the step-time model the workers themselves are timed by (Dynamo's fitted polynomials, see
//! `workers/src/mocker/perf.rs`) and a vLLM-like scheduler: each step has a budget of
//! `step_tokens` tokens, decoding sequences take one token of it each, prefill fills the rest.
//!
//! For each LLM worker `i` with block size `bs`, device overlap `d`, host overlap `h`, queued
//! prefill `Q = prefill_tokens[i]` and `D = active_requests[i]` (taken as decoders; the few of
//! them still in prefill are already in `Q`, so this slightly overstates the decode load):
//!
//! - `prefill_ms(T) = prefill_a·T² + prefill_b·T + prefill_c`, and
//!   `decode_ms(u) = max(1, decode_a·u² + decode_b·u + decode_c)` with `u` clamped to `[0, 1]`.
//! - New tokens `n = max(0, prompt_tokens − bs·(d + host_credit·h))` (host blocks still need a
//!   copy back, so they earn less credit, as in Dynamo and `kv-aware`).
//! - Prefill tokens per step `P = max(B − D, B/8)` with `B = step_tokens`; the floor keeps a
//!   worker with more decoders than budget from dividing by ~0.
//! - `TTFT = max(1, (Q + n)/P) · prefill_ms(min(Q + n, P) + D)`: the engine serves prefill FIFO,
//!   so the request waits for the whole queue and then its own tokens, in steps of `P` prefill
//!   tokens plus the `D` decode tokens riding along. Work that fits one step costs exactly that
//!   one (small) step; a long queue costs full steps and grows linearly, not quadratically, in
//!   `Q` (continuous: the last partial step is charged pro rata).
//! - `new_blocks = max(0, prompt_blocks − d)`, KV usage
//!   `u = (active_blocks[i] + new_blocks) / capacity` (capacity `default_capacity_blocks` when
//!   the table reports 0 = unknown), and the request's own decode estimate is
//!   `max_tokens · decode_ms(u)`: a fuller cache makes every decode step slower.
//! - Interference, the delay this request's prefill inflicts on the worker's decoders: each
//!   step that carries its `n` tokens is a prefill step instead of a decode step for all `D` of
//!   them, so `interference = D · s · max(0, prefill_ms(min(n, P) + D) − decode_ms(u))` with
//!   `s = max(1, n/P)` steps when `n > 0`, else 0. It is in milliseconds summed over the
//!   decoders; `interference_weight` converts it into this request's milliseconds.
//! - Impact, the engine time the request's own uncached tokens take from every request that
//!   arrives after it on the same worker (chunked prefill is served in order, so they all wait
//!   behind it): `impact = n/P · prefill_ms(P + D)`, its tokens in full steps. Minimising one's
//!   own TTFT alone is greedy; at high load the real price of `n` uncached tokens is paid again
//!   by the queue behind them, and a prefix computed on a second worker also duplicates blocks
//!   there and evicts others. `impact_weight` prices that. It is what makes this router beat
//!   `kv-aware` (`benchmarks/history/routing.md`): on the Mooncake conversation trace near
//!   saturation, weights of 4–16 raised the engines' prefix-cache hit ratio from ~19 % to ~24 %
//!   and cut preemptions ~5×; the default is 4.
//! - Memory pressure: KV blocks past `memory_threshold · capacity` (after admitting the
//!   request) will be recomputed after a preemption or waited for, so they cost their prefill
//!   time, `pressure = max(0, blocks − memory_threshold · capacity) · bs/P · prefill_ms(P + D)`.
//!   A threshold of 0.8 balanced memory at the cache's expense and made TTFT worse; the default
//!   0.95 only guards the edge.
//! - The cost: `TTFT + decode_weight · max_tokens · decode_ms(u) + interference_weight ·
//!   interference + impact_weight · impact + memory_weight · pressure`.
//!
//! A worker whose KV capacity the request would overflow (`active_blocks + new_blocks >
//! capacity`, when capacity > 0) is used only if every worker would overflow. The lowest cost
//! wins; costs equal within 1e-9 (relative) are broken by a hash of the request id, as in
//! `kv-aware` (policies have no random source, and this keeps equal workers evenly used). The
//! next two workers in the same order are the decision's fallbacks.
//!
//! Every coefficient is a config key, read once per call; the defaults are the mocker's own
//! constants: `prefill_a` 4.209989e-7, `prefill_b` 1.518344e-2, `prefill_c` 16.50142, `decode_a`
//! −25.74, `decode_b` 54.01, `decode_c` 5.74, `step_tokens` 8192, `host_credit` 0.75,
//! `decode_weight` 0.05, `interference_weight` 0, `impact_weight` 4, `memory_threshold` 0.95,
//! `memory_weight` 1, `default_capacity_blocks` 16384.
//!
//! Speed: every worker's cost is first estimated in `f64`, two workers per Wasm SIMD
//! instruction (`Model::estimates`), and only the workers within 2⁻³⁰ (relative) of the third
//! least estimate are predicted and ranked as above (`model::shortlist`); when the ranking's
//! tied group or fallbacks reach past the workers whose place is certain, or the settings are
//! outside what the estimate covers (a negative prefill coefficient or weight), every worker is.
//! The answer is the same either way; `shortlist = false` ranks every worker always.
//!
//! # Rejected designs
//!
//! On the Mooncake conversation trace at 9× with 8 simulated engines, one round each (single
//! runs at this load vary by ±20 %); the runs are in `benchmarks/history/routing.md`.
//!
//! - No impact term (greedy TTFT): it beat `kv-aware` at 8× (TTFT avg 416 vs 517 ms) but lost to
//!   it at 9× (1,538 vs 1,255 ms).
//! - A memory-pressure term from 80 % of capacity: TTFT avg 1,076 ms with `impact_weight = 1`,
//!   against 688 ms without it: spreading memory costs cache hits.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable};

/// The policy.
pub struct PredictedTtft;

/// How many next-best workers the decision names as fallbacks.
const FALLBACKS: usize = 2;

use switchyard_ttft_model as model;
pub use switchyard_ttft_model::{Model, Prediction};

impl Router for PredictedTtft {
    const COLUMNS: Columns = model::COLUMNS;

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        model::choose(&Model::configured(), req, workers, FALLBACKS)
    }
}

switchyard_policy_sdk::router!(PredictedTtft);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::testing;

    /// `prefill_ms` with the mocker's constants, for hand computations.
    fn prefill(t: f64) -> f64 {
        4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142
    }

    fn close(actual: f64, expected: f64) -> bool {
        (actual - expected).abs() <= 1e-9 * expected.abs().max(1.0)
    }

    #[test]
    fn idle_workers_send_the_request_to_the_cached_prefix() {
        // 1024 tokens at block size 64: 16 blocks, 12 cached on worker 1, so it prefills 256.
        let mut table = testing::table(3);
        table.overlap_device_blocks = vec![0, 12, 0];
        let request = testing::request(1, 1024);
        let decision = testing::route::<PredictedTtft>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 1);
        assert_eq!(decision.fallbacks.len(), 2);
        assert!(!decision.fallbacks.contains(&1));
        let model = Model::default();
        // On an idle worker the work fits one step: TTFT is one step of exactly that work.
        assert!(close(model.predict(&request, &table.view(), 1).ttft_ms, prefill(256.0)));
        assert!(close(
            model.predict(&request, &table.view(), 0).ttft_ms,
            prefill(1024.0)
        ));
        // A fully cached prompt still costs one (nearly empty) step, not zero.
        table.overlap_device_blocks = vec![0, 16, 0];
        assert!(close(model.predict(&request, &table.view(), 1).ttft_ms, prefill(0.0)));
    }

    #[test]
    fn a_long_prefill_queue_outweighs_the_cache() {
        // Without the impact term (see `the_impact_term_prices_uncached_tokens`):
        // worker 1 caches 12 of 16 blocks (n = 256) but has Q queued tokens; worker 0 is idle
        // with nothing cached (n = 1024). Both have no decoders and no active blocks.
        testing::set_config("impact_weight", "0");
        // cost_0 = prefill(1024) + 0.05·128·decode(16/16384) = 32.4907 + 6.4·5.79272 = 69.5641.
        // cost_1 = prefill(Q + 256) + 6.4·decode(4/16384) = prefill(Q + 256) + 36.8204 while
        // Q + 256 ≤ 8192 (one step). Equal when prefill(W) = 32.7437, i.e.
        // 4.209989e-7·W² + 1.518344e-2·W − 16.2423 = 0 → W ≈ 1039.8, so Q* ≈ 784 tokens.
        let mut table = testing::table(2);
        table.overlap_device_blocks = vec![0, 12];
        let request = testing::request(7, 1024);
        table.prefill_tokens = vec![0, 700];
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            1
        );
        table.prefill_tokens = vec![0, 870];
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            0
        );
        let model = Model {
            impact_weight: 0.0,
            ..Model::default()
        };
        let idle = model.predict(&request, &table.view(), 0).cost;
        assert!(close(idle, 69.564_117_298_074_22), "{idle}");
        table.prefill_tokens = vec![0, 783];
        assert!(model.predict(&request, &table.view(), 1).cost < idle);
        table.prefill_tokens = vec![0, 785];
        assert!(model.predict(&request, &table.view(), 1).cost > idle);
    }

    #[test]
    fn the_impact_term_prices_uncached_tokens() {
        // The table of `a_long_prefill_queue_outweighs_the_cache` at Q = 870, where the idle
        // worker wins on predicted TTFT alone. Impact = n/P · prefill_ms(P): 1024 uncached
        // tokens on worker 0 against 256 on worker 1, so at the default weight 4 worker 1 pays
        // 4 · 768/8192 · prefill(8192) = 63.4 ms less for them and keeps the request.
        let mut table = testing::table(2);
        table.overlap_device_blocks = vec![0, 12];
        table.prefill_tokens = vec![0, 870];
        let request = testing::request(7, 1024);
        let model = Model::default();
        let idle = model.predict(&request, &table.view(), 0);
        let cached = model.predict(&request, &table.view(), 1);
        assert!(close(idle.impact_ms, 1024.0 / 8192.0 * prefill(8192.0)));
        assert!(close(cached.impact_ms, 256.0 / 8192.0 * prefill(8192.0)));
        assert!(idle.ttft_ms < cached.ttft_ms, "{idle:?} {cached:?}");
        assert!(cached.cost < idle.cost, "{idle:?} {cached:?}");
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            1
        );
        // A queue long enough still sends it to the idle worker: one more full step of
        // queue (8192 tokens) outweighs the 63.4 ms.
        table.prefill_tokens = vec![0, 870 + 8192];
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            0
        );
        // A fully cached prompt has no impact.
        table.overlap_device_blocks = vec![0, 16];
        assert_eq!(model.predict(&request, &table.view(), 1).impact_ms, 0.0);
    }

    #[test]
    fn memory_pressure_costs_the_blocks_past_the_threshold() {
        // Capacity 1000 blocks, threshold 0.95: worker 0 would hold 940 + 16 = 956 blocks, 6
        // past 950, priced as 6·64 tokens of full steps; worker 1 holds 900 + 16 = 916.
        let mut table = testing::table(2);
        table.capacity_blocks = vec![1000, 1000];
        table.active_blocks = vec![940, 900];
        let request = testing::request(4, 1024);
        let model = Model::default();
        let full = model.predict(&request, &table.view(), 0);
        let roomy = model.predict(&request, &table.view(), 1);
        assert!(
            close(full.pressure_ms, 6.0 * 64.0 / 8192.0 * prefill(8192.0)),
            "{full:?}"
        );
        assert_eq!(roomy.pressure_ms, 0.0);
        assert!(close(
            full.cost - roomy.cost,
            full.pressure_ms + 128.0 * 0.05 * (full.decode_step_ms - roomy.decode_step_ms)
        ));
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            1
        );
        testing::set_config("memory_weight", "0");
        testing::set_config("decode_weight", "0");
        // Without the pressure and decode terms the two are equal and the id breaks the tie.
        assert!(close(
            Model::from_config().predict(&request, &table.view(), 0).cost,
            Model::from_config().predict(&request, &table.view(), 1).cost
        ));
    }

    #[test]
    fn many_decoders_cost_less_than_a_long_prefill_queue() {
        // Worker 0: 200 decoders holding 4000 blocks, nothing queued. Worker 1: 16384 queued
        // prefill tokens of 4 requests holding 64 blocks. kv-aware calls worker 1 cheaper (its
        // 272 prefill + 80 decode blocks + 4 requests against 4016 + 16 + 200), but the engine
        // serves worker 0's request in one mixed step while worker 1's waits for two full ones.
        let mut table = testing::table(2);
        table.active_requests = vec![200, 4];
        table.active_blocks = vec![4000, 64];
        table.prefill_tokens = vec![0, 16_384];
        let request = testing::request(3, 1024);
        let model = Model::default();
        let decoders = model.predict(&request, &table.view(), 0);
        let queue = model.predict(&request, &table.view(), 1);
        // Worker 0: P = 8192 − 200 = 7992 ≥ 1024, one step of 1024 + 200 tokens.
        assert!(close(decoders.ttft_ms, prefill(1224.0)));
        // Worker 1: P = 8188, (16384 + 1024)/8188 = 2.126 steps of 8188 + 4 tokens.
        assert!(close(queue.ttft_ms, 17_408.0 / 8188.0 * prefill(8192.0)));
        assert!(decoders.ttft_ms < queue.ttft_ms);
        // The fuller cache makes worker 0's decode steps slower (u = 4016/16384 ≈ 0.245).
        assert!(decoders.decode_step_ms > queue.decode_step_ms);
        assert!(decoders.cost < queue.cost, "{decoders:?} {queue:?}");
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            0
        );
        // A queue grows linearly: twice (and four times) the work is ~twice the steps.
        table.prefill_tokens = vec![0, 2 * 81_880 - 1024];
        let long = model.predict(&request, &table.view(), 1).ttft_ms;
        table.prefill_tokens = vec![0, 4 * 81_880 - 1024];
        assert!(close(model.predict(&request, &table.view(), 1).ttft_ms, 2.0 * long));
    }

    #[test]
    fn overflow_is_avoided_unless_every_worker_overflows() {
        // Worker 0 caches 4 blocks but would need 12 new blocks on top of 95 of 100.
        let mut table = testing::table(2);
        table.overlap_device_blocks = vec![4, 0];
        table.active_blocks = vec![95, 0];
        table.capacity_blocks = vec![100, 16_384];
        table.prefill_tokens = vec![0, 20_000];
        let request = testing::request(5, 1024);
        let model = Model::default();
        assert!(model.predict(&request, &table.view(), 0).overflows);
        assert!(model.predict(&request, &table.view(), 0).cost < model.predict(&request, &table.view(), 1).cost);
        let decision = testing::route::<PredictedTtft>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 1);
        assert_eq!(decision.fallbacks, vec![0], "the overflowing worker comes last");
        // When both overflow the cheaper one is used anyway.
        table.capacity_blocks = vec![100, 10];
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            0
        );
        // Unknown capacity (0) never counts as overflowing.
        table.capacity_blocks = vec![0, 0];
        assert!(!model.predict(&request, &table.view(), 0).overflows);
    }

    #[test]
    fn ties_are_broken_by_the_request_id() {
        let table = testing::table(4);
        let mut picks = std::collections::HashSet::new();
        for id in 0..64 {
            let request = testing::request(id, 1024);
            let first = testing::route::<PredictedTtft>(&request, &table).expect("a decision");
            let again = testing::route::<PredictedTtft>(&request, &table).expect("a decision");
            assert_eq!((again.worker, &again.fallbacks), (first.worker, &first.fallbacks));
            picks.insert(first.worker);
        }
        assert_eq!(picks.len(), 4, "equal workers are all used: {picks:?}");
    }

    use switchyard_policy_sdk::testing::Draws;

    #[test]
    fn the_shortlist_decides_as_every_exact_cost_does() {
        let mut draws = Draws(5);
        let mut decided = 0;
        for round in 0..3000u64 {
            let n = 1 + draws.below(60) as usize;
            let mut table = testing::table(n);
            for i in 0..n {
                table.roles[i] = if draws.below(10) == 0 { 1 } else { 0 };
                table.block_size[i] = [16, 32, 64, 48][draws.below(4) as usize];
                table.overlap_device_blocks[i] = draws.value(40);
                table.overlap_host_blocks[i] = draws.value(8);
                table.prefill_tokens[i] = draws.value(30_000);
                table.active_requests[i] = draws.value(300);
                table.active_blocks[i] = draws.value(2_000);
                table.capacity_blocks[i] = [0, 1_000, 2_000, 16_384][draws.below(4) as usize];
            }
            let mut request = testing::request(round, 1 + draws.below(20_000));
            request.max_tokens = draws.below(1024);
            // Now and then other weights, some outside what the estimates take.
            let settings: &[(&str, &str)] = match draws.below(4) {
                0 => &[("interference_weight", "0.5"), ("memory_threshold", "0.5")],
                1 => &[("impact_weight", "0"), ("decode_a", "3"), ("step_tokens", "2048")],
                2 => &[("prefill_a", "-1e-7")],
                _ => &[],
            };
            for (key, value) in settings {
                testing::set_config(key, value);
            }
            testing::set_config("shortlist", "true");
            let fast = testing::route::<PredictedTtft>(&request, &table).map(|d| (d.worker, d.fallbacks));
            testing::set_config("shortlist", "false");
            let exact = testing::route::<PredictedTtft>(&request, &table).map(|d| (d.worker, d.fallbacks));
            assert_eq!(fast.ok(), exact.ok(), "round {round}, settings {settings:?}");
            let model = Model::from_config();
            if let Some(shortlist) = model::shortlist(&model, &request, &table.view()) {
                let mut ranked: Vec<(bool, f64, usize, ())> = shortlist
                    .candidates
                    .iter()
                    .map(|&i| {
                        let prediction = model.predict(&request, &table.view(), i as usize);
                        (prediction.overflows, prediction.cost, i as usize, ())
                    })
                    .collect();
                model::rank(&mut ranked, request.request_id);
                decided += usize::from(model::shortlist_decides(&ranked, shortlist.certain_below, FALLBACKS));
            }
            for (key, _) in settings {
                testing::set_config(key, "nan-means-default");
            }
        }
        assert!(decided > 1500, "the shortlist decided {decided} of 3000");
    }

    #[test]
    fn non_llm_workers_are_skipped_and_none_is_an_error() {
        let mut table = testing::table(3);
        table.roles = vec![1, 0, 2];
        let request = testing::request(9, 512);
        let decision = testing::route::<PredictedTtft>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 1);
        assert!(decision.fallbacks.is_empty());
        table.roles = vec![1, 1, 2];
        assert!(testing::route::<PredictedTtft>(&request, &table).is_err());
    }

    #[test]
    fn config_keys_override_the_defaults() {
        // Worker 0 holds 12 host blocks, worker 1 holds 10 device blocks. At the default host
        // credit 0.75 worker 0 is credited 9 blocks (n = 448) against worker 1's 10 (n = 384).
        let mut table = testing::table(2);
        table.overlap_host_blocks = vec![12, 0];
        table.overlap_device_blocks = vec![0, 10];
        let request = testing::request(11, 1024);
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            1
        );
        testing::set_config("host_credit", "1.0");
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            0
        );

        // The decoders-versus-queue table: with interference counted, worker 0's 200 decoders
        // each lose ~18 ms to this prefill (3657 ms in all), and the queue wins.
        let mut table = testing::table(2);
        table.active_requests = vec![200, 4];
        table.active_blocks = vec![4000, 64];
        table.prefill_tokens = vec![0, 16_384];
        let request = testing::request(3, 1024);
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            0
        );
        testing::set_config("interference_weight", "0.1");
        assert_eq!(
            testing::route::<PredictedTtft>(&request, &table)
                .expect("a decision")
                .worker,
            1
        );

        // Every coefficient: prefill_ms(T) = T, decode_ms = 2, 1000-token steps.
        for (key, value) in [
            ("prefill_a", "0"),
            ("prefill_b", "1"),
            ("prefill_c", "0"),
            ("decode_a", "0"),
            ("decode_b", "0"),
            ("decode_c", "2"),
            ("step_tokens", "1000"),
            ("host_credit", "0.5"),
            ("decode_weight", "1"),
            ("interference_weight", "1"),
            ("default_capacity_blocks", "100"),
            ("impact_weight", "0.5"),
            ("memory_threshold", "0.9"),
            ("memory_weight", "2"),
        ] {
            testing::set_config(key, value);
        }
        let model = Model::from_config();
        let mut table = testing::table(1);
        table.overlap_device_blocks = vec![2];
        table.overlap_host_blocks = vec![4];
        table.prefill_tokens = vec![1200];
        table.active_requests = vec![10];
        table.active_blocks = vec![90];
        table.capacity_blocks = vec![0];
        let request = testing::request(1, 1024);
        let prediction = model.predict(&request, &table.view(), 0);
        // n = 1024 − 64·(2 + 0.5·4) = 768, P = 990, TTFT = (1968/990)·(990 + 10).
        assert!(close(prediction.ttft_ms, 1968.0 / 990.0 * 1000.0), "{prediction:?}");
        assert!(close(prediction.decode_step_ms, 2.0));
        // One own step of 768 + 10 tokens instead of a 2 ms decode step, for 10 decoders.
        assert!(close(prediction.interference_ms, 10.0 * 776.0));
        // Impact: 768/990 steps of 1000 ms. Pressure: 104 − 90 = 14 blocks past the threshold
        // (of the default capacity), 14·64 tokens in steps of 990 at 1000 ms.
        assert!(close(prediction.impact_ms, 768.0 / 990.0 * 1000.0), "{prediction:?}");
        assert!(
            close(prediction.pressure_ms, 14.0 * 64.0 / 990.0 * 1000.0),
            "{prediction:?}"
        );
        assert!(close(
            prediction.cost,
            prediction.ttft_ms + 128.0 * 2.0 + 7760.0 + 0.5 * prediction.impact_ms + 2.0 * prediction.pressure_ms
        ));
        // Capacity 0 → the default 100 for the usage (90 + 14 blocks, u clamped to 1), but an
        // unknown capacity never counts as overflowing.
        assert!(!prediction.overflows);
    }

    #[test]
    fn nonsense_config_does_not_break_the_order() {
        testing::set_config("prefill_a", "nan");
        testing::set_config("step_tokens", "0");
        let table = testing::table(3);
        let request = testing::request(2, 1024);
        let decision = testing::route::<PredictedTtft>(&request, &table).expect("a decision");
        assert!(decision.worker < 3);
        assert_eq!(Model::from_config().step_tokens, 1.0);
    }
}
