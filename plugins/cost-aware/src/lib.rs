//! `cost-aware`: the cheapest worker predicted to meet the request's time-to-first-token
//! target; when none is, the one `predicted-ttft` would pick with each worker's measured speed.
//!
//! **Prediction.** Each LLM worker's TTFT is predicted with `predicted-ttft`'s model (the
//! engines' step-time polynomials, its queue, cache overlap and decoders), then scaled by the
//! worker's slowness: its typical gap between chunks (the `measured` import: each stream's
//! median gap, so the few steps that also carried prefill do not count; matched by the `ids`
//! column) over the fastest measured worker's. A worker whose steps take twice as long (an
//! older spot GPU) has its prediction doubled; a worker measured on fewer than
//! [`MIN_SAMPLES`] streams is taken as fast as the fastest. Why relative and not against the
//! model's step: see [`Slowness`].
//!
//! **Measured prefill.** Where the gateway has measured a worker's prefill (the
//! `measured.prefill-fits` import: a line from the prefill work a request found there to its
//! time to first token, over at least [`MIN_FITTED`] requests), that line replaces the model's
//! scaled prefill terms for it: the TTFT is the line at the queued work plus the request's
//! uncached tokens, the time alone the line at its own tokens, and its own steps the line's
//! rate times its tokens. The model's queue time underrates a loaded slow worker (its measured
//! decode gap is a ratio to the fastest worker's, whose own load inflates it, and the decoders
//! sharing its steps slow its prefill further); the line measures how fast that worker's queue
//! really drains.
//!
//! **Choice.** Candidates are the workers the request would not overflow (KV capacity, as
//! `predicted-ttft` checks it) that are predicted to give its first token within
//! `target_margin` × `ttft-target-ms` (the margin is room for the requests arriving
//! meanwhile). `own_steps_headroom` adds that share of the request's own prefill steps
//! (`predicted-ttft`'s impact) to the time checked, as room for the next arrival on the same
//! worker; its default, 0, leaves them out: counting them keeps large prompts off cheap workers
//! that could serve them in time. Among the candidates the lowest `cost` (per token; spot <
//! reserved) wins, ties (within 1e-6) going to the lowest scaled cost as `predicted-ttft` ranks
//! it, so equal workers share the load and cached prefixes count. A request without a target
//! takes every worker as a candidate, so it goes to the cheapest.
//!
//! **No candidate.** When no worker is predicted to meet the target, the lowest scaled
//! `predicted-ttft` cost wins (its queue, cache, impact and decode terms, not the raw TTFT: a
//! late request should not also spoil the queue behind it), first among the workers that could
//! meet the target with nothing queued ahead (their own prefill steps, scaled, within the
//! target), and only then among the rest: a prompt too large for a slow worker even when idle
//! stays off it, where a short queue would otherwise draw it there, late for sure. The
//! fallbacks are the next two in the same order.
//!
//! **Assumptions.** The `cost` column is a per-token price comparable across workers. A
//! worker without a fitted prefill line is slower than the fastest by one factor, its decode
//! gap's, across prefill and decode.
//!
//! **Settings.** `predicted-ttft`'s coefficients (the same keys); `target_margin` (default
//! 0.8), the share of the target a candidate's predicted time may take; `own_steps_headroom`
//! (default 0), the share of the request's own steps added to that time; `measured_prefill`
//! (default true; false ignores the fitted lines and predicts from the model alone); and
//! `shortlist` (default true; false predicts the workers one at a time, the path the lanes are
//! checked against). Otherwise every worker is predicted two per instruction where the settings
//! allow it ([`model::Model::predict_all`], bit for bit the same predictions).
//!
//! # Rejected designs
//!
//! On the mixed fleet of `BENCHMARKS.md` (4 regular and 4 spot engines, 2,000 ms targets) and,
//! for speed, `cargo bench -p switchyard --bench policy_call -- route/`; the runs are in
//! `benchmarks/history/cost-aware.md` and `benchmarks/history/policy-calls.md`.
//!
//! - A worker's slowness measured against the model's step at the gateway's view of its load:
//!   that view counts queued requests the engine has not started, so a loaded worker looked
//!   fast and drew more load (196 s p99 TTFT in a trial run).
//! - A slack rule (a cheaper worker only while its predicted cost is within 25 % of the target
//!   of the best): 78.9 % of targets met at 6×, but at 2× dearer than `predicted-ttft` (832,671
//!   against 768,376 per 1M tokens).
//! - `target_margin = 1.0` as the default: 88.5 against 91.8 % of targets met at 6×, same run.
//! - No own steps counted only while other workers had nothing waiting to prefill: 87.4 against
//!   90.6 % at 6× with any one other worker idle as the test, 88.2 against 89.7 % with half.
//! - Each worker ranked as it is predicted, with no list of predictions: the same speed (4,096
//!   workers 139.7 / 137.8 → 141.8 / 134.9 µs).
//! - The tie-break hashed only when two workers tie on key and cost: 5–8 % slower (19.4 →
//!   20.8 µs at 1,024 workers), as such ties are common.

#![cfg_attr(not(test), no_std)]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable};

use switchyard_ttft_model::{self as model, Model};

/// The policy.
pub struct CostAware;

/// How many next-best workers the decision names as fallbacks.
const FALLBACKS: usize = 2;

/// Streams a worker must have been measured on before its speed counts.
const MIN_SAMPLES: u32 = 3;

/// Requests a worker's prefill line must be fitted to before it replaces the model there.
const MIN_FITTED: u32 = 8;

/// A worker's measured prefill: time to first token against the prefill work it finds.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Drain {
    fixed_ms: f64,
    ms_per_token: f64,
}

impl Drain {
    /// Predicted time to first token with `tokens` of prefill work (its own included).
    fn at(&self, tokens: f64) -> f64 {
        self.fixed_ms + self.ms_per_token * tokens
    }
}

/// What a `measured` import said, by worker id (the first item of an id counts, as a scan
/// would find it). Ids are the gateway's, given out in order, so they are mostly dense: then
/// a slot per id up to the largest, and a worker's item is one load; where the ids are spread
/// wider than [`DENSE_IDS`] slots per item, the items sorted by id and a binary search (a scan
/// per worker was quadratic). None at all when the import said nothing.
enum ById<T> {
    /// `slots[id]`: the item of `id`, if any.
    Dense(Vec<Option<T>>),
    /// Sorted by id, stably.
    Sorted(Vec<(u32, T)>),
}

/// Slots per item, plus a few, that [`ById`] spends on a table indexed by id.
const DENSE_IDS: usize = 4;

impl<T: Copy> ById<T> {
    fn new(items: impl Iterator<Item = (u32, T)>) -> ById<T> {
        let mut items: Vec<(u32, T)> = items.collect();
        let largest = items.iter().map(|(id, _)| *id as usize).max();
        match largest {
            None => ById::Dense(Vec::new()),
            Some(largest) if largest < DENSE_IDS * items.len() + 64 => {
                let mut slots = alloc::vec![None; largest + 1];
                for (id, item) in items {
                    if let Some(slot @ None) = slots.get_mut(id as usize) {
                        *slot = Some(item);
                    }
                }
                ById::Dense(slots)
            }
            Some(_) => {
                items.sort_by_key(|(id, _)| *id);
                ById::Sorted(items)
            }
        }
    }

    /// Whether the import said nothing.
    fn is_empty(&self) -> bool {
        match self {
            ById::Dense(slots) => slots.is_empty(),
            ById::Sorted(items) => items.is_empty(),
        }
    }

    /// Worker `i`'s item, matched by the `ids` column; `None` when there is none.
    fn of(&self, workers: &WorkerTable, i: usize) -> Option<T> {
        if self.is_empty() {
            return None;
        }
        let id = workers.ids.get(i).copied()?;
        match self {
            ById::Dense(slots) => slots.get(id as usize).copied().flatten(),
            ById::Sorted(items) => {
                let first = items.partition_point(|(item, _)| *item < id);
                items
                    .get(first)
                    .filter(|(item, _)| *item == id)
                    .map(|(_, value)| *value)
            }
        }
    }
}

/// The measured prefill lines, by worker id; none where one was fitted to fewer than
/// [`MIN_FITTED`] requests or makes no sense, nor any at all when `measured` is false.
fn drains(measured: bool) -> ById<Drain> {
    if !measured {
        return ById::new(core::iter::empty());
    }
    let mut fits = switchyard_policy_sdk::measured::prefill_fits();
    fits.retain(|fit| {
        fit.samples >= MIN_FITTED
            && fit.fixed_ms.is_finite()
            && fit.ms_per_ktoken.is_finite()
            && fit.fixed_ms >= 0.0
            && fit.ms_per_ktoken >= 0.0
    });
    ById::new(fits.into_iter().map(|fit| {
        let drain = Drain {
            fixed_ms: f64::from(fit.fixed_ms),
            ms_per_token: f64::from(fit.ms_per_ktoken) / 1000.0,
        };
        (fit.id, drain)
    }))
}

/// Each worker's slowness relative to the fastest measured one (1 = as fast; 2.5 = takes 2.5
/// times as long per step), from the measured timings.
///
/// Relative, not against the model's expected step: a worker's measured gap grows with its own
/// load (a fuller KV cache makes every step longer), and the load the gateway sees includes
/// queued requests the engine has not started, so comparing a gap with the model's step at
/// that load makes a loaded worker look fast and draws more load to it. Every worker carries
/// load, so the ratio of gaps keeps mostly the hardware's difference, and what is left of the
/// load makes a busy worker look slower — which turns traffic away from it, the stable way.
struct Slowness {
    /// Each worker's typical gap between chunks, in µs.
    gaps: ById<f64>,
    /// The least gap of the table's LLM workers (`+∞` when none was measured).
    fastest: f64,
}

impl Slowness {
    /// From the measured timings: those of at least [`MIN_SAMPLES`] streams count.
    fn measured(workers: &WorkerTable) -> Slowness {
        let mut measured = switchyard_policy_sdk::measured::timings();
        measured.retain(|timing| timing.itl_us > 0 && timing.samples >= MIN_SAMPLES);
        let gaps = ById::new(measured.iter().map(|timing| (timing.id, f64::from(timing.itl_us))));
        let fastest = if gaps.is_empty() {
            f64::INFINITY
        } else {
            workers
                .llm_indices()
                .filter_map(|i| gaps.of(workers, i))
                .fold(f64::INFINITY, f64::min)
        };
        Slowness { gaps, fastest }
    }

    /// Worker `i`'s slowness: 1 where it was not measured.
    fn of(&self, workers: &WorkerTable, i: usize) -> f64 {
        match self.gaps.of(workers, i) {
            Some(gap) if self.fastest.is_finite() && self.fastest > 0.0 => (gap / self.fastest).clamp(1.0, 100.0),
            _ => 1.0,
        }
    }
}

impl Router for CostAware {
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::IDS)
        .union(Columns::COST)
        .union(Columns::BLOCK_SIZE)
        .union(Columns::OVERLAP_DEVICE_BLOCKS)
        .union(Columns::OVERLAP_HOST_BLOCKS)
        .union(Columns::PREFILL_TOKENS)
        .union(Columns::ACTIVE_REQUESTS)
        .union(Columns::ACTIVE_BLOCKS)
        .union(Columns::CAPACITY_BLOCKS);

    fn route(req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let model = Model::configured();
        static MARGIN: switchyard_policy_sdk::config::Derived<f64> = switchyard_policy_sdk::config::Derived::new();
        let margin = MARGIN.get_or_init(|| switchyard_policy_sdk::config::get_f64("target_margin", 0.8));
        static OWN_STEPS: switchyard_policy_sdk::config::Derived<f64> = switchyard_policy_sdk::config::Derived::new();
        let own_steps = OWN_STEPS.get_or_init(|| switchyard_policy_sdk::config::get_f64("own_steps_headroom", 0.0));
        static MEASURED: switchyard_policy_sdk::config::Derived<bool> = switchyard_policy_sdk::config::Derived::new();
        let measured = MEASURED.get_or_init(|| switchyard_policy_sdk::config::get_bool("measured_prefill", true));
        let predictions = model.predict_all(req, workers);
        let slowness = Slowness::measured(workers);
        let drains = drains(measured);
        let target = f64::from(req.ttft_target_ms);

        // A worker the request would overflow is usable only when every worker would.
        let entries = workers.llm_indices().filter_map(|i| {
            let prediction = predictions.get(i)?;
            let (speed, drain) = (slowness.of(workers, i), drains.of(workers, i));
            let queued_tokens = f64::from(workers.prefill_tokens.get(i).copied().unwrap_or(0));
            let usable = !prediction.overflows;
            let price = f64::from(workers.cost.get(i).copied().unwrap_or(1.0));
            // The prefill terms: the worker's measured line where there is one, else the
            // model's, scaled by its slowness.
            let (ttft, alone, impact) = match drain {
                Some(drain) => (
                    drain.at(queued_tokens + prediction.new_tokens),
                    drain.at(prediction.new_tokens),
                    drain.ms_per_token * prediction.new_tokens,
                ),
                None => (
                    prediction.ttft_ms * speed,
                    prediction.alone_ms * speed,
                    prediction.impact_ms * speed,
                ),
            };
            let cost = if prediction.cost.is_finite() {
                (prediction.cost - prediction.ttft_ms) * speed + ttft
            } else {
                f64::INFINITY
            };
            // Checked against the margin: this request's TTFT (its queue and its own
            // prefill), plus the share of its own steps `own_steps_headroom` leaves as room
            // for the next arrival here.
            let busy = ttft + own_steps * impact;
            let meets = usable && (target <= 0.0 || busy <= target * margin);
            // Could meet the target with nothing queued ahead: a worker too slow for the
            // prompt even idle is the last resort, whatever its queue.
            let able = usable && (target <= 0.0 || alone <= target);
            let tie = model::mix(req.request_id ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            Some(Entry {
                usable,
                meets,
                able,
                key: if meets { price } else { cost },
                cost,
                tie,
                index: i,
            })
        });
        let ranked = best(entries, 1 + FALLBACKS);
        let first = ranked
            .first()
            .ok_or_else(|| PolicyError::new("no LLM worker in the table"))?;
        let mut decision = Decision::to(first.index);
        decision.fallbacks = ranked.iter().skip(1).take(FALLBACKS).map(|r| r.index as u32).collect();
        Ok(decision)
    }
}

/// One worker as ranked.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Entry {
    /// The request would not overflow it (or would overflow every worker).
    usable: bool,
    /// Predicted to meet the target, with the room `target_margin` asks.
    meets: bool,
    /// Predicted to meet the target if nothing were queued ahead.
    able: bool,
    /// The price per token where it meets the target, else its scaled predicted cost.
    key: f64,
    /// Its scaled predicted cost.
    cost: f64,
    /// The request's tie-break hash.
    tie: u64,
    /// Its index in the table.
    index: usize,
}

/// Usable first; meeting workers first, cheapest first; then those that could meet the target
/// idle, then the rest, each by scaled predicted cost. Keys equal within 1e-6 are ranked by
/// predicted cost, then by the request's hash.
fn order(a: &Entry, b: &Entry) -> core::cmp::Ordering {
    b.usable
        .cmp(&a.usable)
        .then_with(|| b.meets.cmp(&a.meets))
        .then_with(|| b.able.cmp(&a.able))
        .then_with(|| {
            if (a.key - b.key).abs() <= 1e-6 * a.key.abs().max(b.key.abs()).max(1.0) {
                core::cmp::Ordering::Equal
            } else {
                a.key.total_cmp(&b.key)
            }
        })
        .then_with(|| a.cost.total_cmp(&b.cost))
        .then_with(|| a.tie.cmp(&b.tie))
}

/// The first `count` of `entries` (in table order) in [`order`], ties in table order, as a
/// stable sort would put them: kept in order as the workers go by, not a sort of all of them
/// (which cost more than the predictions at a thousand workers).
fn best(entries: impl IntoIterator<Item = Entry>, count: usize) -> Vec<Entry> {
    let mut best: Vec<Entry> = Vec::with_capacity(count + 1);
    for entry in entries {
        if best.len() == count
            && best
                .last()
                .is_some_and(|last| order(&entry, last) != core::cmp::Ordering::Less)
        {
            continue;
        }
        let at = best.partition_point(|kept| order(kept, &entry) != core::cmp::Ordering::Greater);
        best.insert(at, entry);
        best.truncate(count);
    }
    best
}

switchyard_policy_sdk::router!(CostAware);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::measured::WorkerTiming;
    use switchyard_policy_sdk::testing;

    /// Worker 0: reserved (cost 1), as fast as the model; worker 1: spot (cost 0.4), measured
    /// twice as slow.
    fn fleet() -> testing::Table {
        let mut table = testing::table(2);
        table.cost = alloc::vec![1.0, 0.4];
        let expected_us = (Model::default().decode_ms(0.0) * 1000.0) as u32;
        testing::set_timings(alloc::vec![
            WorkerTiming {
                id: 0,
                itl_us: expected_us,
                samples: 5
            },
            WorkerTiming {
                id: 1,
                itl_us: expected_us * 2,
                samples: 5
            },
        ]);
        table
    }

    fn route(target_ms: f32) -> u32 {
        let table = fleet();
        let mut request = testing::request(3, 512);
        request.ttft_target_ms = target_ms;
        testing::route::<CostAware>(&request, &table)
            .expect("a decision")
            .worker
    }

    #[test]
    fn the_cheap_worker_takes_what_it_can_meet() {
        // 512 tokens on an idle worker: a first token after one step of about 24 ms at the
        // model's speed, 48 ms on the spot worker measured twice as slow.
        assert_eq!(route(0.0), 1, "no target: the cheapest");
        assert_eq!(route(1000.0), 1, "a loose target the spot worker meets");
        assert_eq!(route(50.0), 0, "a target only the reserved worker meets (40 ms)");
        assert_eq!(route(1.0), 0, "a target nobody meets: the fastest");
    }

    /// A target whose margin leaves the spot worker (measured twice as slow) room for the
    /// request's first token and three quarters of its own steps after it, not all of them.
    fn roomy_for_three_quarters_of_its_steps() -> f32 {
        let spot = Model::default().predict(&testing::request(3, 512), &fleet().view(), 1);
        let (ttft, steps) = (spot.ttft_ms * 2.0, spot.impact_ms * 2.0);
        assert!(steps > 1.0, "{spot:?}");
        ((ttft + 0.75 * steps) / 0.8) as f32
    }

    #[test]
    fn own_steps_headroom_sets_how_much_of_its_own_steps_a_request_leaves_room_for() {
        let target = roomy_for_three_quarters_of_its_steps();
        assert_eq!(route(target), 1, "the default: none of them, its first token in time");
        testing::set_config("own_steps_headroom", "0.5");
        assert_eq!(route(target), 1, "half of them");
        testing::set_config("own_steps_headroom", "0.9");
        assert_eq!(route(target), 0, "nine tenths");
        testing::set_config("own_steps_headroom", "1");
        assert_eq!(route(target), 0, "all of them");
    }

    #[test]
    fn a_prompt_the_slow_worker_cannot_meet_even_idle_stays_off_it() {
        // 40,000 tokens: ~4.9 full steps, ~0.83 s on the reserved worker when idle, ~1.65 s
        // on the spot worker measured twice as slow. The reserved worker has six such prompts
        // queued, so nobody is predicted to meet a 1.5 s target; the spot worker's scaled cost
        // is the lower (its queue is empty), but only the reserved one could ever meet it.
        let mut table = fleet();
        table.prefill_tokens = alloc::vec![240_000, 0];
        let mut request = testing::request(3, 40_000);
        request.ttft_target_ms = 1500.0;
        let model = Model::default();
        let [reserved, spot] = [0, 1].map(|i| model.predict(&request, &table.view(), i));
        assert!(reserved.alone_ms <= 1500.0 && spot.alone_ms * 2.0 > 1500.0);
        assert!(reserved.ttft_ms > 1500.0, "nobody meets it");
        assert!(
            spot.cost * 2.0 < reserved.cost,
            "the spot worker's scaled cost is the lower"
        );
        let decision = testing::route::<CostAware>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 0, "the worker that could meet it when idle");
        assert_eq!(decision.fallbacks, alloc::vec![1]);
    }

    #[test]
    fn a_worker_measured_to_drain_its_queue_slowly_is_not_taken_for_the_model() {
        use switchyard_policy_sdk::measured::PrefillFit;
        // The spot worker has 8,000 tokens queued; the model, scaled by its decode gap, has it
        // meet a 1 s target. Its measured line says its queue drains at 0.2 ms a token: 1.7 s.
        let mut table = fleet();
        table.prefill_tokens = alloc::vec![0, 8_000];
        let mut request = testing::request(3, 512);
        request.ttft_target_ms = 1000.0;
        let model = Model::default();
        let spot = model.predict(&request, &table.view(), 1);
        assert!(
            (spot.ttft_ms + spot.impact_ms) * 2.0 <= 800.0,
            "the model has the spot worker meet it: {spot:?}"
        );
        let fits = |samples| {
            alloc::vec![
                PrefillFit {
                    id: 0,
                    fixed_ms: 10.0,
                    ms_per_ktoken: 20.0,
                    samples,
                },
                PrefillFit {
                    id: 1,
                    fixed_ms: 20.0,
                    ms_per_ktoken: 200.0,
                    samples,
                },
            ]
        };
        testing::set_prefill_fits(fits(MIN_FITTED));
        let decision = testing::route::<CostAware>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 0, "measured, the spot worker misses it");

        testing::set_prefill_fits(fits(MIN_FITTED - 1));
        let decision = testing::route::<CostAware>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 1, "too few requests fitted: the model decides");

        testing::set_prefill_fits(fits(MIN_FITTED));
        testing::set_config("measured_prefill", "false");
        let decision = testing::route::<CostAware>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 1, "measured_prefill = false: the model decides");
    }

    #[test]
    fn a_measured_line_that_makes_no_sense_is_ignored() {
        use switchyard_policy_sdk::measured::PrefillFit;
        let table = fleet();
        let mut request = testing::request(3, 512);
        request.ttft_target_ms = 1000.0;
        // Each of these lines, if taken, would put the spot worker past the target.
        for (fixed_ms, ms_per_ktoken) in [(f32::NAN, 1.0), (1.0, f32::INFINITY), (-5.0, 5_000.0), (5_000.0, -1.0)] {
            testing::set_prefill_fits(alloc::vec![PrefillFit {
                id: 1,
                fixed_ms,
                ms_per_ktoken,
                samples: 100,
            }]);
            let decision = testing::route::<CostAware>(&request, &table).expect("a decision");
            assert_eq!(decision.worker, 1, "the model decides: the idle spot worker meets it");
        }
    }

    #[test]
    fn the_best_few_are_a_stable_sorts_first() {
        let mut state = 3u64;
        let mut draw = |bound: u64| {
            state = model::mix(state);
            state % bound
        };
        for _ in 0..2000 {
            let n = 1 + draw(40) as usize;
            let entries: Vec<Entry> = (0..n)
                .map(|i| {
                    let usable = draw(6) != 0;
                    let meets = usable && draw(2) == 0;
                    let able = meets || (usable && draw(2) == 0);
                    let price = [0.4, 1.0, 2.5][draw(3) as usize];
                    let cost = [10.0, 20.0, 20.0 + 1e-9][draw(3) as usize];
                    Entry {
                        usable,
                        meets,
                        able,
                        key: if meets { price } else { cost },
                        cost,
                        tie: draw(3),
                        index: i,
                    }
                })
                .collect();
            let mut sorted = entries.clone();
            sorted.sort_by(order);
            let count = 1 + draw(3) as usize;
            assert_eq!(best(entries, count), sorted[..count.min(n)]);
        }
    }

    #[test]
    fn an_unmeasured_worker_is_taken_at_the_models_speed() {
        let mut table = testing::table(2);
        table.cost = alloc::vec![1.0, 0.4];
        testing::set_timings(alloc::vec![]);
        let mut request = testing::request(3, 512);
        request.ttft_target_ms = 100.0;
        let decision = testing::route::<CostAware>(&request, &table).expect("a decision");
        assert_eq!(decision.worker, 1, "both meet it as far as is known: the cheaper");
        assert_eq!(decision.fallbacks, alloc::vec![0]);
    }

    use switchyard_policy_sdk::testing::Draws;

    /// Every part of a prediction as bits, so that −0 and +0 differ.
    fn bits(parts: &model::exact::Parts) -> [u64; 6] {
        [
            parts.ttft_ms,
            parts.alone_ms,
            parts.impact_ms,
            parts.new_tokens,
            parts.cost,
            f64::from(u8::from(parts.overflows)),
        ]
        .map(f64::to_bits)
    }

    #[test]
    fn predictions_in_lanes_are_bit_for_bit_the_ones_by_one() {
        // `predict_all` (two workers per instruction where its settings allow) against
        // `predict` worker by worker: every field's bits, on tables with idle and overflowing
        // workers, zeros and values up to u32::MAX, and settings including negative zeros, a
        // negative decode polynomial, and ones outside what the lanes take (which fall back).
        let mut draws = Draws(7);
        let mut in_lanes = 0;
        for round in 0..3000u64 {
            let n = 1 + draws.below(70) as usize;
            let mut table = testing::table(n);
            let huge = draws.below(8) == 0;
            let big = |draws: &mut Draws, bound: u32| {
                if huge && draws.below(4) == 0 {
                    u32::MAX - draws.below(3)
                } else {
                    draws.value(bound)
                }
            };
            for i in 0..n {
                table.roles[i] = if draws.below(10) == 0 { 1 } else { 0 };
                table.block_size[i] = [0, 16, 32, 64, 48][draws.below(5) as usize];
                table.overlap_device_blocks[i] = big(&mut draws, 40);
                table.overlap_host_blocks[i] = big(&mut draws, 8);
                table.prefill_tokens[i] = big(&mut draws, 30_000);
                table.active_requests[i] = big(&mut draws, 9_000);
                table.active_blocks[i] = big(&mut draws, 2_000);
                table.capacity_blocks[i] = [0, 1_000, 2_000, 16_384, u32::MAX][draws.below(5) as usize];
            }
            let mut request = testing::request(round, big(&mut draws, 20_000));
            request.prompt_blocks = big(&mut draws, 400);
            request.max_tokens = big(&mut draws, 1024);
            let settings: &[(&str, &str)] = match draws.below(8) {
                0 => &[("interference_weight", "0.5"), ("memory_threshold", "0.5")],
                1 => &[("impact_weight", "0"), ("decode_a", "3"), ("step_tokens", "2048")],
                2 => &[
                    ("prefill_a", "-0.0"),
                    ("prefill_b", "-0.0"),
                    ("prefill_c", "-0.0"),
                    ("host_credit", "-0.0"),
                    ("memory_threshold", "-0.0"),
                    ("interference_weight", "-0.0"),
                ],
                3 => &[
                    ("decode_a", "-60"),
                    ("decode_b", "-0.0"),
                    ("decode_c", "0"),
                    ("interference_weight", "2"),
                ],
                4 => &[("step_tokens", "1"), ("default_capacity_blocks", "0.5")],
                5 => &[("prefill_a", "1e300")],
                6 => &[("prefill_a", "-1e-7")],
                _ => &[],
            };
            for (key, value) in settings {
                testing::set_config(key, value);
            }
            let model = Model::from_config();
            in_lanes += usize::from(model.predicts_in_lanes());
            let view = table.view();
            let predictions = model.predict_all(&request, &view);
            for i in view.llm_indices() {
                let one = model.predict(&request, &view, i);
                let one = model::exact::Parts {
                    ttft_ms: one.ttft_ms,
                    alone_ms: one.alone_ms,
                    impact_ms: one.impact_ms,
                    new_tokens: one.new_tokens,
                    cost: one.cost,
                    overflows: one.overflows,
                };
                let lane = predictions.get(i).expect("every worker predicted");
                assert_eq!(
                    bits(&lane),
                    bits(&one),
                    "round {round}, worker {i}, settings {settings:?}: {lane:?} against {one:?}"
                );
            }
            for (key, _) in settings {
                testing::set_config(key, "nan-means-default");
            }
        }
        assert!(
            (1500..3000).contains(&in_lanes),
            "{in_lanes} of 3000 rounds predicted in lanes"
        );
    }

    #[test]
    fn an_id_finds_its_first_item_dense_or_spread() {
        // `ById` against a scan for the first item of each id: ids given out in order (a slot
        // per id), ids spread wide (sorted, binary search), repeated ids, ids past the items,
        // and a table whose `ids` column is short.
        let mut draws = Draws(23);
        let mut dense = 0;
        for round in 0..2000u32 {
            let spread = [1, 3, 1000, 1 << 20][draws.below(4) as usize];
            let items: Vec<(u32, u32)> = (0..draws.below(40)).map(|k| (draws.below(50) * spread, k)).collect();
            let by_id = ById::new(items.iter().copied());
            dense += u32::from(matches!(by_id, ById::Dense(_)));
            let n = 1 + draws.below(60) as usize;
            let mut table = testing::table(n);
            for id in table.ids.iter_mut() {
                *id = draws.below(55) * spread;
            }
            table.ids.truncate(n - draws.below(2) as usize);
            let view = table.view();
            for i in 0..n {
                let scan = view
                    .ids
                    .get(i)
                    .and_then(|id| items.iter().find(|(item, _)| item == id))
                    .map(|(_, k)| *k);
                assert_eq!(by_id.of(&view, i), scan, "round {round}, worker {i}");
            }
        }
        assert!((600..1400).contains(&dense), "{dense} of 2000 rounds indexed by slot");
    }
}
