//! The performance model behind `predicted-ttft` (see its crate docs for every term): the
//! predicted time to first token of a request on one LLM worker and the cost around it. A crate
//! of its own so that `predicted-ttft`, `modality-aware` and `cost-aware` share the very same
//! model without linking one another's exported router.
//!
//! # Rejected designs
//!
//! - One four-at-a-time loop for `predicted-ttft`'s estimates and `cost-aware`'s lanes (they read
//!   the same eight columns, which `Four::columns` gathers for both): `predicted-ttft`'s
//!   estimates were 15–25 % slower, so the loops stay apart.

#![no_std]

extern crate alloc;

use alloc::vec::Vec;

use switchyard_policy_sdk::lanes::{F64x2, U32x4};
use switchyard_policy_sdk::shortlist::{Least3, at_most_f64};
use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, WorkerTable, config, role, scratch};

/// The worker-table columns [`Model::predict`] and [`choose`] read.
pub const COLUMNS: Columns = Columns::ROLES
    .union(Columns::BLOCK_SIZE)
    .union(Columns::OVERLAP_DEVICE_BLOCKS)
    .union(Columns::OVERLAP_HOST_BLOCKS)
    .union(Columns::PREFILL_TOKENS)
    .union(Columns::ACTIVE_REQUESTS)
    .union(Columns::ACTIVE_BLOCKS)
    .union(Columns::CAPACITY_BLOCKS);

pub mod disagg;

/// The performance model and the weights of the cost, from the policy's config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Model {
    /// Quadratic, linear and constant coefficients of `prefill_ms(T)`.
    pub prefill: [f64; 3],
    /// Quadratic, linear and constant coefficients of `decode_ms(u)`.
    pub decode: [f64; 3],
    /// Token budget of one engine step (at least 1).
    pub step_tokens: f64,
    /// Cache credit of a host-memory block relative to a device block.
    pub host_credit: f64,
    /// Weight of the request's own decode time, `max_tokens · decode_ms(u)`.
    pub decode_weight: f64,
    /// Weight of the delay the request's prefill inflicts on the worker's decoders.
    pub interference_weight: f64,
    /// KV capacity assumed for a worker that reports 0 (unknown).
    pub default_capacity_blocks: f64,
    /// Fraction of the KV capacity past which blocks count as memory pressure.
    pub memory_threshold: f64,
    /// Weight of the memory-pressure time (the blocks past the threshold, as recompute work).
    pub memory_weight: f64,
    /// Weight of the engine time the request's own uncached tokens take from later requests.
    pub impact_weight: f64,
    /// Whether to rank a [`shortlist`] (config key `shortlist`, default true) rather than every
    /// worker's exact cost; the answer is the same (see [`shortlist`]).
    pub shortlisted: bool,
}

impl Default for Model {
    /// The mocker's constants (`workers/src/mocker/perf.rs`) and the default weights.
    fn default() -> Model {
        Model {
            prefill: [4.209989e-7, 1.518344e-2, 16.50142],
            decode: [-25.74, 54.01, 5.74],
            step_tokens: 8192.0,
            host_credit: 0.75,
            decode_weight: 0.05,
            interference_weight: 0.0,
            default_capacity_blocks: 16_384.0,
            memory_threshold: 0.95,
            memory_weight: 1.0,
            impact_weight: 4.0,
            shortlisted: true,
        }
    }
}

/// What the model predicts for one worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Predicted time to first token, in milliseconds.
    pub ttft_ms: f64,
    /// The same with nothing queued ahead of the request: its own prefill steps, the least it
    /// could take on this worker.
    pub alone_ms: f64,
    /// Predicted duration of one decode step at the KV usage after admitting the request.
    pub decode_step_ms: f64,
    /// Delay the request's prefill inflicts, in milliseconds summed over the decoders.
    pub interference_ms: f64,
    /// Engine time of the KV blocks past the memory threshold, taken as work to recompute.
    pub pressure_ms: f64,
    /// Engine time the request's own uncached tokens take, in full steps.
    pub impact_ms: f64,
    /// The request's uncached prompt tokens on this worker.
    pub new_tokens: f64,
    /// Prefill tokens queued ahead of it there (the table's `prefill-tokens`).
    pub queued_tokens: f64,
    /// The cost to minimise (never NaN; +∞ where the inputs make no sense).
    pub cost: f64,
    /// Whether the request would overflow the worker's KV capacity.
    pub overflows: bool,
}

/// Element `i` of a table column, or 0 when the column is short (the host builds equal-length
/// columns, but a short one must not trap the policy).
pub fn at(column: &[u32], i: usize) -> f64 {
    column.get(i).copied().map(f64::from).unwrap_or(0.0)
}

impl Model {
    /// The model of the policy's config, read once per instance ([`Model::from_config`]).
    pub fn configured() -> Model {
        static MODEL: config::Derived<Model> = config::Derived::new();
        MODEL.get_or_init(Model::from_config)
    }

    /// The model with every coefficient read from the policy's config, defaulting to
    /// [`Model::default`].
    pub fn from_config() -> Model {
        let defaults = Model::default();
        let get = |key: &str, default: f64| config::get_f64(key, default);
        Model {
            prefill: [
                get("prefill_a", defaults.prefill[0]),
                get("prefill_b", defaults.prefill[1]),
                get("prefill_c", defaults.prefill[2]),
            ],
            decode: [
                get("decode_a", defaults.decode[0]),
                get("decode_b", defaults.decode[1]),
                get("decode_c", defaults.decode[2]),
            ],
            // A budget below one token would make every queue infinite; NaN also becomes 1.
            step_tokens: get("step_tokens", defaults.step_tokens).max(1.0),
            host_credit: get("host_credit", defaults.host_credit),
            decode_weight: get("decode_weight", defaults.decode_weight),
            interference_weight: get("interference_weight", defaults.interference_weight),
            default_capacity_blocks: get("default_capacity_blocks", defaults.default_capacity_blocks),
            memory_threshold: get("memory_threshold", defaults.memory_threshold),
            memory_weight: get("memory_weight", defaults.memory_weight),
            impact_weight: get("impact_weight", defaults.impact_weight),
            shortlisted: config::get_bool("shortlist", defaults.shortlisted),
        }
    }

    /// Milliseconds of one step that computes `tokens` tokens (prefill plus riding decodes).
    pub fn prefill_ms(&self, tokens: f64) -> f64 {
        let [a, b, c] = self.prefill;
        (a * tokens + b) * tokens + c
    }

    /// Milliseconds of one decode-only step at KV usage `usage` (clamped to `[0, 1]`), never
    /// below 1 ms, as the mocker times it.
    pub fn decode_ms(&self, usage: f64) -> f64 {
        let [a, b, c] = self.decode;
        let u = usage.clamp(0.0, 1.0);
        ((a * u + b) * u + c).max(1.0)
    }

    /// Prefill tokens one step computes beside `decoders` decoding sequences: the step's
    /// budget less theirs, at least an eighth of it (so that a worker with more decoders than
    /// budget does not divide by ~0).
    pub fn prefill_per_step(&self, decoders: f64) -> f64 {
        (self.step_tokens - decoders).max(self.step_tokens / 8.0)
    }

    /// Milliseconds until the first token of `new_tokens` prompt tokens queued behind `queued`
    /// others, beside `decoders` decoding sequences: the queue and then the prompt, in steps of
    /// [`Model::prefill_per_step`] tokens plus the decoders' (one step at least).
    pub fn first_token_ms(&self, queued: f64, new_tokens: f64, decoders: f64) -> f64 {
        let per_step = self.prefill_per_step(decoders);
        let work = queued + new_tokens;
        (work / per_step).max(1.0) * self.prefill_ms(work.min(per_step) + decoders)
    }

    /// The prediction for routing `req` to worker `i`.
    pub fn predict(&self, req: &RequestInfo, workers: &WorkerTable, i: usize) -> Prediction {
        let block_size = at(workers.block_size, i).max(1.0);
        let device = at(workers.overlap_device_blocks, i);
        let host = at(workers.overlap_host_blocks, i);
        let queued = at(workers.prefill_tokens, i);
        let decoders = at(workers.active_requests, i);

        let new_tokens = (f64::from(req.prompt_tokens) - block_size * (device + self.host_credit * host)).max(0.0);
        let per_step = self.prefill_per_step(decoders);
        let ttft_ms = self.first_token_ms(queued, new_tokens, decoders);
        let alone_ms = self.first_token_ms(0.0, new_tokens, decoders);

        let new_blocks = (f64::from(req.prompt_blocks) - device).max(0.0);
        let blocks = at(workers.active_blocks, i) + new_blocks;
        let reported = at(workers.capacity_blocks, i);
        let capacity = if reported > 0.0 {
            reported
        } else {
            self.default_capacity_blocks
        };
        let decode_step_ms = self.decode_ms(blocks / capacity);

        let own_steps = if new_tokens > 0.0 {
            (new_tokens / per_step).max(1.0)
        } else {
            0.0
        };
        let interference_ms =
            decoders * own_steps * (self.prefill_ms(new_tokens.min(per_step) + decoders) - decode_step_ms).max(0.0);

        let full_step_ms = self.prefill_ms(per_step + decoders);
        let over_threshold = (blocks - self.memory_threshold * capacity).max(0.0);
        let pressure_ms = over_threshold * block_size / per_step * full_step_ms;
        let impact_ms = new_tokens / per_step * full_step_ms;

        let cost = ttft_ms
            + self.decode_weight * f64::from(req.max_tokens) * decode_step_ms
            + self.interference_weight * interference_ms
            + self.memory_weight * pressure_ms
            + self.impact_weight * impact_ms;
        Prediction {
            ttft_ms,
            alone_ms,
            decode_step_ms,
            interference_ms,
            pressure_ms,
            impact_ms,
            new_tokens,
            queued_tokens: queued,
            // A NaN (from a NaN coefficient in the config) would make the order meaningless.
            cost: if cost.is_nan() { f64::INFINITY } else { cost },
            overflows: reported > 0.0 && blocks > reported,
        }
    }
}

/// How far an estimate of [`Model::estimates`] may be from [`Model::predict`]'s cost: a
/// relative part and an absolute part in milliseconds. Both compute the same formula in `f64`,
/// the estimate with reciprocals instead of divisions and in another order, which moves a
/// result by a few units in the last place (2⁻⁵² relative) of its largest term; these bounds
/// leave a margin of ~2²² over that.
const ESTIMATE_RELATIVE: f64 = 1.0 / (1u64 << 30) as f64;
const ESTIMATE_ABSOLUTE_MS: f64 = 1.0 / (1u64 << 24) as f64;

/// What [`shortlist`] found: the workers whose exact ranking decides, and the cost below which
/// a worker's place in that ranking is certain.
pub struct Shortlist {
    /// Indices, ascending: every worker whose estimate is within the bound of the third least.
    pub candidates: Vec<u32>,
    /// Every worker not on the list has an exact cost at least this (or would overflow), so
    /// the candidates below it come first in the full ranking, in the same order.
    pub certain_below: f64,
}

impl Model {
    /// Whether [`Model::estimates`]' bound holds for these settings: every number finite, the
    /// prefill polynomial's coefficients and every weight non-negative (then every term of the
    /// cost is a sum of non-negative products, whose rounding stays relative to the cost; the
    /// decode polynomial may have any sign, its value is clamped to at least 1 ms).
    pub fn estimable(&self) -> bool {
        let finite = self.prefill.iter().chain(&self.decode).all(|value| value.is_finite())
            && [
                self.step_tokens,
                self.host_credit,
                self.decode_weight,
                self.interference_weight,
                self.default_capacity_blocks,
                self.memory_threshold,
                self.memory_weight,
                self.impact_weight,
            ]
            .iter()
            .all(|value| value.is_finite() && *value >= 0.0);
        finite && self.prefill.iter().all(|value| *value >= 0.0) && self.default_capacity_blocks > 0.0
    }

    /// [`Model::predict`]'s cost for every worker in table order, two workers per Wasm SIMD
    /// instruction, `+∞` for workers that are not LLMs or that the request would overflow;
    /// and the three least. `None` when a column is short or the settings are not
    /// [`Model::estimable`].
    pub fn estimates(&self, req: &RequestInfo, workers: &WorkerTable) -> Option<(Vec<f64>, [f64; 3])> {
        if !self.estimable() {
            return None;
        }
        let n = workers.len();
        let columns = Four::columns(workers)?;
        let lanes = Lanes::new(self, req);
        let mut keys: Vec<f64> = scratch::vec(n + 3);
        keys.resize(n.div_ceil(4) * 4, 0.0);
        let (out, _) = keys.as_chunks_mut::<2>();
        // Split where the loop ends, so that its stores need no test (see `kv-aware`: with a
        // test per store, LLVM computes the estimates twice).
        let (body, last) = out.split_at_mut(n / 4 * 2);
        let (body, _) = body.as_chunks_mut::<2>();
        let [
            roles,
            block_size,
            device,
            host,
            queued,
            decoders,
            active_blocks,
            capacity,
        ] = columns.map(|column| column.as_chunks::<4>().0);
        let mut least = Least3::new();
        // Written out column by column (see `kv-aware`: arrays of vectors built in the loop
        // are not kept in registers).
        for (q, [out_low, out_high]) in body.iter_mut().enumerate() {
            let four = Four {
                roles: U32x4::load(&roles[q]),
                block_size: U32x4::load(&block_size[q]),
                device: U32x4::load(&device[q]),
                host: U32x4::load(&host[q]),
                queued: U32x4::load(&queued[q]),
                decoders: U32x4::load(&decoders[q]),
                active_blocks: U32x4::load(&active_blocks[q]),
                capacity: U32x4::load(&capacity[q]),
            };
            let (low, high) = lanes.four(&four);
            least.take(low);
            least.take(high);
            low.store(out_low);
            high.store(out_high);
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
                queued,
                decoders,
                active_blocks,
                capacity,
            ] = padded.each_ref().map(U32x4::load);
            let four = Four {
                roles,
                block_size,
                device,
                host,
                queued,
                decoders,
                active_blocks,
                capacity,
            };
            let (low, high) = lanes.four(&four);
            least.take(low);
            least.take(high);
            if let [out_low, out_high, ..] = last {
                low.store(out_low);
                high.store(out_high);
            }
        }
        keys.truncate(n);
        Some((keys, least.finish()))
    }
}

/// Every worker's exact prediction, two per instruction: what `cost-aware` ranks, as
/// [`Model::predict_all`]. A module of its own so that the routers that include this file and
/// do not use it (`predicted-ttft`, `modality-aware`) need not carry an allowance each.
#[allow(
    dead_code,
    reason = "cost-aware's; predicted-ttft and modality-aware include this file too"
)]
pub mod exact {
    use super::{F64x2, Four, Lanes, Model, RequestInfo, U32x4, Vec, WorkerTable, role, scratch};

    /// How large a coefficient may be for [`Model::predict_all`] to take two workers per
    /// instruction (2⁶⁴): with every column and request number below 2³², no term of a prediction
    /// then comes near `f64`'s range (the largest, a weighted pressure or interference time, stays
    /// below 2³³⁰), so no lane becomes infinite or NaN.
    const LANES_COEFFICIENT_LIMIT: f64 = 18_446_744_073_709_551_616.0;

    /// Two workers' [`Parts`], field by field, as the lanes store them: time to first token,
    /// alone, impact, uncached tokens, cost, and overflow (1 or 0).
    type PairOfParts = [[f64; 2]; 6];

    /// Every worker's [`Parts`], from [`Model::predict_all`].
    pub struct Predictions {
        /// Workers `2k` and `2k + 1`'s parts at `k`.
        pairs: Vec<PairOfParts>,
    }

    /// What `cost-aware` ranks by of a worker's [`Prediction`](super::Prediction): the same
    /// values, without the terms it does not read.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct Parts {
        /// [`Prediction::ttft_ms`](super::Prediction::ttft_ms).
        pub ttft_ms: f64,
        /// [`Prediction::alone_ms`](super::Prediction::alone_ms).
        pub alone_ms: f64,
        /// [`Prediction::impact_ms`](super::Prediction::impact_ms).
        pub impact_ms: f64,
        /// [`Prediction::new_tokens`](super::Prediction::new_tokens).
        pub new_tokens: f64,
        /// [`Prediction::cost`](super::Prediction::cost).
        pub cost: f64,
        /// [`Prediction::overflows`](super::Prediction::overflows).
        pub overflows: bool,
    }

    impl Predictions {
        /// Worker `i`'s parts; `None` past the table. A worker that is not an LLM has meaningless
        /// ones.
        pub fn get(&self, i: usize) -> Option<Parts> {
            let pair = self.pairs.get(i / 2)?;
            let lane = i % 2;
            let [ttft_ms, alone_ms, impact_ms, new_tokens, cost, overflows] = pair.map(|field| field[lane]);
            Some(Parts {
                ttft_ms,
                alone_ms,
                impact_ms,
                new_tokens,
                // As `predict` does: a NaN would make the order meaningless.
                cost: if cost.is_nan() { f64::INFINITY } else { cost },
                overflows: overflows != 0.0,
            })
        }
    }

    impl Model {
        /// Whether [`Model::predict_all`] may predict in lanes with these settings: the fast path
        /// is on (config key `shortlist`), the settings are [`Model::estimable`], the step budget
        /// is at least one token and no coefficient's magnitude passes [`LANES_COEFFICIENT_LIMIT`].
        pub fn predicts_in_lanes(&self) -> bool {
            let settings = [
                self.step_tokens,
                self.host_credit,
                self.decode_weight,
                self.interference_weight,
                self.default_capacity_blocks,
                self.memory_threshold,
                self.memory_weight,
                self.impact_weight,
            ];
            self.shortlisted
                && self.estimable()
                && self.step_tokens >= 1.0
                && (self.prefill.iter().chain(&self.decode).chain(&settings))
                    .all(|value| value.abs() <= LANES_COEFFICIENT_LIMIT)
        }

        /// [`Model::predict`]'s [`Parts`] for every LLM worker.
        ///
        /// Two workers per Wasm SIMD instruction where [`Model::predicts_in_lanes`] holds and the
        /// columns are whole, and then bit for bit what predicting the workers one at a time
        /// gives: the lanes run the same IEEE operations in the same order (divisions included,
        /// where the estimates use a reciprocal), and the only ones whose answer can differ, `max`
        /// and `min` (the lanes' `pmax`/`pmin` against `f64::max`/`min`), agree unless an operand
        /// is NaN or the two are zeros of opposite sign. The coefficient limit rules out NaN, and
        /// with [`Model::estimable`]'s non-negative coefficients no operand of a `max` or `min` is
        /// −0: the overlaps, loads and request numbers are non-negative integers, a difference
        /// `x − y` is −0 only for `x = −0`, and the one term that can be −0, the decode polynomial
        /// of a negative coefficient at zero usage, is compared with 1.
        pub fn predict_all(&self, req: &RequestInfo, workers: &WorkerTable) -> Predictions {
            if let Some(pairs) = self.predict_in_lanes(req, workers) {
                return Predictions { pairs };
            }
            let n = workers.roles.len().max(workers.len());
            let mut pairs = alloc::vec![[[0.0; 2]; 6]; n.div_ceil(2)];
            for i in workers.llm_indices() {
                let p = self.predict(req, workers, i);
                let parts = [
                    p.ttft_ms,
                    p.alone_ms,
                    p.impact_ms,
                    p.new_tokens,
                    p.cost,
                    f64::from(u8::from(p.overflows)),
                ];
                if let Some(pair) = pairs.get_mut(i / 2) {
                    for (field, value) in pair.iter_mut().zip(parts) {
                        field[i % 2] = value;
                    }
                }
            }
            Predictions { pairs }
        }

        /// [`Model::predict_all`] in lanes; `None` where the lanes cannot promise the same bits.
        fn predict_in_lanes(&self, req: &RequestInfo, workers: &WorkerTable) -> Option<Vec<PairOfParts>> {
            let n = workers.len();
            // `llm_indices` walks the roles column whatever its length: the lanes take the table's.
            if !self.predicts_in_lanes() || workers.roles.len() != n {
                return None;
            }
            let columns = Four::columns(workers)?;
            let lanes = Lanes::new(self, req);
            let mut pairs: Vec<PairOfParts> = scratch::vec(n.div_ceil(4) * 2);
            pairs.resize(n.div_ceil(4) * 2, [[0.0; 2]; 6]);
            // Split where the loop ends, so that its stores need no test (see `kv-aware`).
            let (body, last) = pairs.split_at_mut(n / 4 * 2);
            let (body, _) = body.as_chunks_mut::<2>();
            let [_, block_size, device, host, queued, decoders, active_blocks, capacity] =
                columns.map(|column| column.as_chunks::<4>().0);
            for (q, [low, high]) in body.iter_mut().enumerate() {
                let four = Four {
                    roles: U32x4::splat(role::LLM),
                    block_size: U32x4::load(&block_size[q]),
                    device: U32x4::load(&device[q]),
                    host: U32x4::load(&host[q]),
                    queued: U32x4::load(&queued[q]),
                    decoders: U32x4::load(&decoders[q]),
                    active_blocks: U32x4::load(&active_blocks[q]),
                    capacity: U32x4::load(&capacity[q]),
                };
                lanes.four_exact(&four, low, high);
            }
            // The last workers that do not fill four lanes, padded with zeros.
            let done = n / 4 * 4;
            if done < n
                && let [low, high, ..] = last
            {
                let mut padded = [[0u32; 4]; 8];
                for (padded, column) in padded.iter_mut().zip(columns) {
                    padded[..n - done].copy_from_slice(&column[done..]);
                }
                let [
                    roles,
                    block_size,
                    device,
                    host,
                    queued,
                    decoders,
                    active_blocks,
                    capacity,
                ] = padded.each_ref().map(U32x4::load);
                let four = Four {
                    roles,
                    block_size,
                    device,
                    host,
                    queued,
                    decoders,
                    active_blocks,
                    capacity,
                };
                lanes.four_exact(&four, low, high);
            }
            Some(pairs)
        }
    }

    impl Lanes {
        /// [`Model::predict`]'s [`Parts`] for four workers, into two pairs.
        #[inline(always)]
        fn four_exact(&self, four: &Four, low: &mut PairOfParts, high: &mut PairOfParts) {
            let block_size = four.block_size.max(U32x4::splat(1));
            self.two_exact(
                [
                    block_size.low_to_f64(),
                    four.device.low_to_f64(),
                    four.host.low_to_f64(),
                    four.queued.low_to_f64(),
                    four.decoders.low_to_f64(),
                    four.active_blocks.low_to_f64(),
                    four.capacity.low_to_f64(),
                ],
                low,
            );
            self.two_exact(
                [
                    block_size.high_to_f64(),
                    four.device.high_to_f64(),
                    four.host.high_to_f64(),
                    four.queued.high_to_f64(),
                    four.decoders.high_to_f64(),
                    four.active_blocks.high_to_f64(),
                    four.capacity.high_to_f64(),
                ],
                high,
            );
        }

        /// [`Model::predict`]'s [`Parts`] for two workers: its operations in its order, term for
        /// term (see [`Model::predict_all`] for why the bits are the same).
        #[inline(always)]
        fn two_exact(
            &self,
            [block_size, device, host, queued, decoders, active_blocks, reported]: [F64x2; 7],
            out: &mut PairOfParts,
        ) {
            let zero = F64x2::splat(0.0);
            let one = F64x2::splat(1.0);
            let new_tokens = (self.prompt - block_size * (device + self.host_credit * host)).max(zero);
            let per_step = (self.step_tokens - decoders).max(self.step_floor);
            let work = queued + new_tokens;
            let ttft = (work / per_step).max(one) * self.prefill_ms(work.min(per_step) + decoders);
            let steps = new_tokens / per_step;
            let own_prefill = self.prefill_ms(new_tokens.min(per_step) + decoders);
            let alone = steps.max(one) * own_prefill;

            let blocks = active_blocks + (self.prompt_blocks - device).max(zero);
            let known = reported.gt(zero);
            let capacity = known.select(reported, self.default_capacity);
            // `clamp(0, 1)` is `max(0)` then `min(1)` for every number.
            let usage = (blocks / capacity).max(zero).min(one);
            let [a, b, c] = self.decode;
            let decode_step = ((a * usage + b) * usage + c).max(one);

            let own_steps = new_tokens.gt(zero).select(steps.max(one), zero);
            let interference = decoders * own_steps * (own_prefill - decode_step).max(zero);
            let full_step = self.prefill_ms(per_step + decoders);
            let over = (blocks - self.memory_threshold * capacity).max(zero);
            let pressure = over * block_size / per_step * full_step;
            let impact = steps * full_step;
            let cost = ttft
                + self.decode_cost * decode_step
                + F64x2::splat(self.interference_weight) * interference
                + self.memory_weight * pressure
                + self.impact_weight * impact;
            let overflows = (known & blocks.gt(reported)).select(one, zero);
            let [out_ttft, out_alone, out_impact, out_new, out_cost, out_overflows] = out;
            ttft.store(out_ttft);
            alone.store(out_alone);
            impact.store(out_impact);
            new_tokens.store(out_new);
            cost.store(out_cost);
            overflows.store(out_overflows);
        }
    }
}

/// Four workers' columns, as [`Lanes::four`] reads them.
struct Four {
    roles: U32x4,
    block_size: U32x4,
    device: U32x4,
    host: U32x4,
    queued: U32x4,
    decoders: U32x4,
    active_blocks: U32x4,
    capacity: U32x4,
}

impl Four {
    /// The eight columns the model reads, in [`Four`]'s order, cut to the table's length;
    /// `None` when one is short.
    fn columns<'a>(workers: &WorkerTable<'a>) -> Option<[&'a [u32]; 8]> {
        let n = workers.len();
        Some([
            workers.roles.get(..n)?,
            workers.block_size.get(..n)?,
            workers.overlap_device_blocks.get(..n)?,
            workers.overlap_host_blocks.get(..n)?,
            workers.prefill_tokens.get(..n)?,
            workers.active_requests.get(..n)?,
            workers.active_blocks.get(..n)?,
            workers.capacity_blocks.get(..n)?,
        ])
    }
}

/// The model's constants and the request's numbers, in both lanes.
struct Lanes {
    prefill: [F64x2; 3],
    decode: [F64x2; 3],
    step_tokens: F64x2,
    step_floor: F64x2,
    host_credit: F64x2,
    default_capacity: F64x2,
    memory_threshold: F64x2,
    decode_cost: F64x2,
    interference_weight: f64,
    memory_weight: F64x2,
    impact_weight: F64x2,
    prompt: F64x2,
    prompt_blocks: F64x2,
}

impl Lanes {
    fn new(model: &Model, req: &RequestInfo) -> Lanes {
        Lanes {
            prefill: model.prefill.map(F64x2::splat),
            decode: model.decode.map(F64x2::splat),
            step_tokens: F64x2::splat(model.step_tokens),
            step_floor: F64x2::splat(model.step_tokens / 8.0),
            host_credit: F64x2::splat(model.host_credit),
            default_capacity: F64x2::splat(model.default_capacity_blocks),
            memory_threshold: F64x2::splat(model.memory_threshold),
            decode_cost: F64x2::splat(model.decode_weight * f64::from(req.max_tokens)),
            interference_weight: model.interference_weight,
            memory_weight: F64x2::splat(model.memory_weight),
            impact_weight: F64x2::splat(model.impact_weight),
            prompt: F64x2::splat(f64::from(req.prompt_tokens)),
            prompt_blocks: F64x2::splat(f64::from(req.prompt_blocks)),
        }
    }

    /// `prefill_ms(tokens)`.
    #[inline(always)]
    fn prefill_ms(&self, tokens: F64x2) -> F64x2 {
        let [a, b, c] = self.prefill;
        (a * tokens + b) * tokens + c
    }

    /// The estimates of four workers, as two pairs.
    #[inline(always)]
    fn four(&self, four: &Four) -> (F64x2, F64x2) {
        let one = U32x4::splat(1);
        let block_size = four.block_size.max(one);
        (
            self.two([
                four.roles.low_to_f64(),
                block_size.low_to_f64(),
                four.device.low_to_f64(),
                four.host.low_to_f64(),
                four.queued.low_to_f64(),
                four.decoders.low_to_f64(),
                four.active_blocks.low_to_f64(),
                four.capacity.low_to_f64(),
            ]),
            self.two([
                four.roles.high_to_f64(),
                block_size.high_to_f64(),
                four.device.high_to_f64(),
                four.host.high_to_f64(),
                four.queued.high_to_f64(),
                four.decoders.high_to_f64(),
                four.active_blocks.high_to_f64(),
                four.capacity.high_to_f64(),
            ]),
        )
    }

    /// [`Model::predict`]'s cost for two workers, `+∞` where not an LLM or overflowing.
    #[inline(always)]
    fn two(
        &self,
        [
            roles,
            block_size,
            device,
            host,
            queued,
            decoders,
            active_blocks,
            reported,
        ]: [F64x2; 8],
    ) -> F64x2 {
        let zero = F64x2::splat(0.0);
        let one = F64x2::splat(1.0);
        let new_tokens = (self.prompt - block_size * (device + self.host_credit * host)).max(zero);
        let per_step = (self.step_tokens - decoders).max(self.step_floor);
        let per_step_inverse = one / per_step;
        let work = queued + new_tokens;
        let ttft = (work * per_step_inverse).max(one) * self.prefill_ms(work.min(per_step) + decoders);
        let blocks = active_blocks + (self.prompt_blocks - device).max(zero);
        let known = reported.gt(zero);
        let capacity = known.select(reported, self.default_capacity);
        let usage = (blocks / capacity).max(zero).min(one);
        let [a, b, c] = self.decode;
        let decode_step = ((a * usage + b) * usage + c).max(one);
        let full_step = self.prefill_ms(per_step + decoders);
        let over = (blocks - self.memory_threshold * capacity).max(zero);
        let steps = new_tokens * per_step_inverse;
        let mut cost = ttft
            + self.decode_cost * decode_step
            + self.memory_weight * (over * block_size * per_step_inverse * full_step)
            + self.impact_weight * (steps * full_step);
        if self.interference_weight != 0.0 {
            let own_steps = new_tokens.gt(zero).select(steps.max(one), zero);
            let delay = (self.prefill_ms(new_tokens.min(per_step) + decoders) - decode_step).max(zero);
            cost = cost + F64x2::splat(self.interference_weight) * (decoders * own_steps * delay);
        }
        let overflows = known & blocks.gt(reported);
        let excluded = overflows | !roles.eq(F64x2::splat(f64::from(role::LLM)));
        excluded.select(F64x2::splat(f64::INFINITY), cost)
    }
}

/// The workers whose exact ranking decides `predicted-ttft`'s answer (and its fallbacks), from
/// [`Model::estimates`]: those within the bound of the third least estimate. `None` when the
/// estimates are not available or no worker is an LLM that fits (the exact ranking orders
/// overflowing workers itself).
pub fn shortlist(model: &Model, req: &RequestInfo, workers: &WorkerTable) -> Option<Shortlist> {
    let (keys, [least, _, third]) = model.estimates(req, workers)?;
    if !least.is_finite() {
        return None;
    }
    // Estimates are within `err(x) = REL·x + ABS` of the exact costs (all non-negative). A
    // worker off the list has an estimate above `limit`, so an exact cost above
    // `limit·(1 − REL) − ABS`; the three least estimates' workers have exact costs at most
    // `third·(1 + REL) + ABS`, below that. With fewer than three fitting LLM workers, the
    // list holds them all (and the rest, overflowing, are not certain to rank after them).
    let limit = if third.is_finite() {
        third * (1.0 + 4.0 * ESTIMATE_RELATIVE) + 4.0 * ESTIMATE_ABSOLUTE_MS
    } else {
        f64::MAX
    };
    Some(Shortlist {
        candidates: at_most_f64(&keys, limit),
        certain_below: limit * (1.0 - ESTIMATE_RELATIVE) - ESTIMATE_ABSOLUTE_MS,
    })
}

/// `ranked` after [`rank`] on a [`Shortlist`]'s candidates: whether the pick and the next
/// `fallbacks` are those the full ranking gives, i.e. the whole tied group and every position
/// up to `fallbacks` are candidates whose place is certain.
pub fn shortlist_decides<T>(ranked: &[(bool, f64, usize, T)], certain_below: f64, fallbacks: usize) -> bool {
    let Some(first) = ranked.first() else {
        return false;
    };
    let (overflows, min) = (first.0, first.1);
    let limit = min + TIE_TOLERANCE * min.abs();
    let tied = ranked.iter().take_while(|r| r.0 == overflows && r.1 <= limit).count();
    let needed = tied.max(1 + fallbacks);
    let certain = ranked.iter().take_while(|r| !r.0 && r.1 < certain_below).count();
    certain >= needed
}

/// The SDK's tie-break hash, which `kv-aware` uses too.
pub use switchyard_policy_sdk::mix;

/// `predicted-ttft`'s choice: the LLM worker of least [`Model::predict`] cost (workers that
/// would overflow their KV capacity last), with the next `fallbacks` as its fallbacks. Ranks
/// only the [`shortlist`] where it decides, every worker otherwise; the answer is the same.
///
/// # Errors
///
/// When the table holds no LLM worker.
pub fn choose(
    model: &Model,
    req: &RequestInfo,
    workers: &WorkerTable,
    fallbacks: usize,
) -> Result<Decision, PolicyError> {
    let rank = |workers_to_rank: &mut dyn Iterator<Item = usize>| {
        let mut ranked: Vec<(bool, f64, usize, ())> = workers_to_rank
            .map(|i| {
                let prediction = model.predict(req, workers, i);
                (prediction.overflows, prediction.cost, i, ())
            })
            .collect();
        let pick = rank(&mut ranked, req.request_id);
        (ranked, pick)
    };
    let decide = |ranked: &[(bool, f64, usize, ())], pick: usize| {
        let mut decision = Decision::to(ranked[pick].2);
        decision.fallbacks = self::fallbacks(ranked, pick, fallbacks);
        decision
    };
    if model.shortlisted
        && let Some(shortlist) = shortlist(model, req, workers)
    {
        let (ranked, pick) = rank(&mut shortlist.candidates.iter().map(|&i| i as usize));
        if let Some(pick) = pick
            && shortlist_decides(&ranked, shortlist.certain_below, fallbacks)
        {
            return Ok(decide(&ranked, pick));
        }
    }
    let (ranked, pick) = rank(&mut workers.llm_indices());
    let pick = pick.ok_or_else(|| PolicyError::new("no LLM worker in the table"))?;
    Ok(decide(&ranked, pick))
}

/// Costs within this fraction of the lowest one count as equal (float noise, not preference).
const TIE_TOLERANCE: f64 = 1e-9;

/// Sorts `ranked` (overflows, cost, worker index, anything) best first: workers that fit
/// before those that would overflow, then by cost, then by index, so that the order of tied
/// workers is stable; then picks among the workers tied for best by a hash of `request_id`
/// (policies have no random source, and this keeps equal workers evenly used). Answers the
/// pick's position, or `None` when `ranked` is empty.
pub fn rank<T>(ranked: &mut [(bool, f64, usize, T)], request_id: u64) -> Option<usize> {
    ranked.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
    let (best_overflows, min) = ranked.first().map(|r| (r.0, r.1))?;
    let limit = min + TIE_TOLERANCE * min.abs();
    let tied = ranked
        .iter()
        .take_while(|r| r.0 == best_overflows && r.1 <= limit)
        .count()
        .max(1);
    let draw = (mix(request_id) >> 11) as f64 / (1u64 << 53) as f64;
    Some(((draw * tied as f64) as usize).min(tied - 1))
}

/// The worker indices of `ranked` after [`rank`], but the pick, best first, at most `count`.
pub fn fallbacks<T>(ranked: &[(bool, f64, usize, T)], pick: usize, count: usize) -> alloc::vec::Vec<u32> {
    ranked
        .iter()
        .enumerate()
        .filter(|(position, _)| *position != pick)
        .take(count)
        .map(|(_, r)| r.2 as u32)
        .collect()
}
