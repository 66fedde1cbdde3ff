//! The performance model behind `predicted-ttft` (see its crate docs for every term): the
//! predicted time to first token of a request on one LLM worker and the cost around it. A file
//! of its own so that `modality-aware` includes the very same model (`#[path]`) without linking
//! this crate's exported router.

use switchyard_policy_sdk::{RequestInfo, WorkerTable, config};

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
}

impl Default for Model {
    /// The mocker's constants (`gpu-workers/src/mocker/perf.rs`) and the default weights.
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
        }
    }
}

/// What the model predicts for one worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Predicted time to first token, in milliseconds.
    pub ttft_ms: f64,
    /// Predicted duration of one decode step at the KV usage after admitting the request.
    pub decode_step_ms: f64,
    /// Delay the request's prefill inflicts, in milliseconds summed over the decoders.
    pub interference_ms: f64,
    /// Engine time of the KV blocks past the memory threshold, taken as work to recompute.
    pub pressure_ms: f64,
    /// Engine time the request's own uncached tokens take, in full steps.
    pub impact_ms: f64,
    /// The cost to minimise (never NaN; +∞ where the inputs make no sense).
    pub cost: f64,
    /// Whether the request would overflow the worker's KV capacity.
    pub overflows: bool,
}

/// Element `i` of a table column, or 0 when the column is short (the host builds equal-length
/// columns, but a short one must not trap the policy).
fn at(column: &[u32], i: usize) -> f64 {
    column.get(i).copied().map(f64::from).unwrap_or(0.0)
}

impl Model {
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

    /// The prediction for routing `req` to worker `i`.
    pub fn predict(&self, req: &RequestInfo, workers: &WorkerTable, i: usize) -> Prediction {
        let block_size = at(workers.block_size, i).max(1.0);
        let device = at(workers.overlap_device_blocks, i);
        let host = at(workers.overlap_host_blocks, i);
        let queued = at(workers.prefill_tokens, i);
        let decoders = at(workers.active_requests, i);

        let new_tokens = (f64::from(req.prompt_tokens) - block_size * (device + self.host_credit * host)).max(0.0);
        let per_step = (self.step_tokens - decoders).max(self.step_tokens / 8.0);
        let work = queued + new_tokens;
        let ttft_ms = (work / per_step).max(1.0) * self.prefill_ms(work.min(per_step) + decoders);

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
            decode_step_ms,
            interference_ms,
            pressure_ms,
            impact_ms,
            // A NaN (from a NaN coefficient in the config) would make the order meaningless.
            cost: if cost.is_nan() { f64::INFINITY } else { cost },
            overflows: reported > 0.0 && blocks > reported,
        }
    }
}

/// A well-mixed 64-bit hash (splitmix64) for tie-breaks, as in `kv-aware`.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
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
