//! `[[workers]]`, `[embedded_mockers]`, `[health]` and `[forwarding]`: the workers, simulated
//! or reached over HTTP, how their health is checked and how requests reach them.

use serde::Deserialize;

use super::{Checked, Invalid, Role, positive};

/// `[health]`: active health checks (`GET /healthz` on every worker).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Time between checks of one worker.
    pub interval_ms: u64,
    /// Time a check may take.
    pub timeout_ms: u64,
    /// Consecutive failures that take a worker out of rotation.
    pub failures_to_eject: u32,
    /// Consecutive successes that bring it back.
    pub successes_to_restore: u32,
}

impl Default for HealthConfig {
    fn default() -> HealthConfig {
        HealthConfig {
            interval_ms: 1_000,
            timeout_ms: 1_000,
            failures_to_eject: 2,
            successes_to_restore: 1,
        }
    }
}

/// `[forwarding]`: the HTTP client to workers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ForwardingConfig {
    /// Time allowed to connect to a worker.
    pub connect_timeout_ms: u64,
    /// Time allowed for a worker's response headers to arrive.
    pub response_timeout_ms: u64,
    /// Idle pooled connections kept per worker.
    pub pool_max_idle_per_worker: usize,
    /// Other workers tried when one fails before its first byte (a busy answer, 429 or 503,
    /// sends the request on without using one).
    pub retries: u32,
    /// Consecutive failed answers (a 5xx other than 503, a timeout, a stream that broke before
    /// its first byte) that open a worker's circuit breaker.
    pub errors_to_eject: u32,
    /// How long a breaker first stays open; each opening in a row doubles it.
    pub breaker_open_ms: u64,
    /// The longest a breaker stays open.
    pub breaker_open_max_ms: u64,
    /// How long a worker that answered 429 or 503 without `Retry-After` is left alone first;
    /// each busy answer in a row doubles it.
    pub busy_backoff_ms: u64,
    /// The longest a busy worker is left alone (a longer `Retry-After` is cut to this).
    pub busy_backoff_max_ms: u64,
    /// How many times one stream broken after its first byte (a worker that crashed, reset
    /// or failed mid-stream) is continued on another worker from its prompt and the tokens
    /// already streamed; 0 (the default) leaves broken streams to end with an error event.
    /// Above 0, a spot worker's streams also move at its reclaim notice (moves not counted). Above 0, streamed requests to workers that report
    /// token ids ask for them, and every chunk is read and rewritten by the gateway.
    pub migration_limit: u32,
    /// How long a prefill worker may take to compute a disaggregated request's prompt (from
    /// sending it to its answer); past it, the answering worker prefills the prompt itself.
    pub prefill_timeout_ms: u64,
}

impl ForwardingConfig {
    /// The breaker's and the busy backoff's settings.
    pub fn backoffs(&self) -> crate::workers::breaker::Backoffs {
        use std::time::Duration;
        crate::workers::breaker::Backoffs {
            errors_to_open: self.errors_to_eject,
            open: Duration::from_millis(self.breaker_open_ms),
            open_max: Duration::from_millis(self.breaker_open_max_ms),
            busy: Duration::from_millis(self.busy_backoff_ms),
            busy_max: Duration::from_millis(self.busy_backoff_max_ms),
        }
    }
}

impl Default for ForwardingConfig {
    fn default() -> ForwardingConfig {
        ForwardingConfig {
            connect_timeout_ms: 2_000,
            response_timeout_ms: 300_000,
            pool_max_idle_per_worker: 256,
            retries: 1,
            errors_to_eject: 3,
            breaker_open_ms: 1_000,
            breaker_open_max_ms: 60_000,
            busy_backoff_ms: 250,
            busy_backoff_max_ms: 5_000,
            migration_limit: 0,
            prefill_timeout_ms: 10_000,
        }
    }
}

/// `[embedded_mockers]`: simulated workers inside the gateway process (the embedded default).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EmbeddedMockers {
    /// How many engines to start.
    pub count: usize,
    /// The model name they serve.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks per engine.
    pub num_gpu_blocks: usize,
    /// Token budget per engine step.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once per engine.
    pub max_num_seqs: usize,
    /// Simulated time runs this many times faster than the perf model.
    pub speedup: f64,
    /// Tokens generated when a request sets no limit.
    pub default_max_tokens: u32,
    /// Simulated vision encoders (images and video) to start beside the engines.
    pub vision_encoders: usize,
    /// Simulated audio encoders to start beside the engines.
    pub audio_encoders: usize,
    /// Engines prefill the text before a request's first media item while it is encoded
    /// (off: a request with media waits for all of it first; the baseline overlap is measured
    /// against).
    pub overlap_prefill: bool,
    /// Multiplies every encode time of the simulated encoders' measured curves.
    pub encoder_cost_scale: f64,
    /// Engines started beside `count` as spot capacity: slower (`spot_speed`) and cheaper
    /// (`spot_cost`), named `embedded-spot-N`; for mixed fleets and cost-aware routing.
    pub spot_count: usize,
    /// A spot engine's speed relative to the others (0.4: 2.5 times slower).
    pub spot_speed: f64,
    /// A spot engine's cost per token (the others cost 1).
    pub spot_cost: f64,
    /// Prefill engines started beside the others, named `embedded-prefill-N` (role `prefill`);
    /// when above 0, the `count` engines take role `decode`. Only a disaggregating router
    /// sends them prompts.
    pub prefill_count: usize,
    /// GB/s over which a decode engine pulls a prompt's KV blocks from a prefill engine (the
    /// engines are taken to run on separate machines; 25: 200 Gb/s RDMA).
    pub kv_link_gbps: f64,
}

impl Default for EmbeddedMockers {
    fn default() -> EmbeddedMockers {
        EmbeddedMockers {
            count: 4,
            model: "mock".into(),
            block_size: 64,
            num_gpu_blocks: 16_384,
            max_num_batched_tokens: 8_192,
            max_num_seqs: 256,
            speedup: 1.0,
            default_max_tokens: 32,
            vision_encoders: 1,
            audio_encoders: 1,
            overlap_prefill: true,
            encoder_cost_scale: 1.0,
            spot_count: 0,
            spot_speed: 0.4,
            spot_cost: 0.4,
            prefill_count: 0,
            kv_link_gbps: 25.0,
        }
    }
}

/// What serves a worker's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Switchyard's own workers (the mocker, `switchyard-llm`, the encoders).
    Switchyard,
    /// vLLM's OpenAI-compatible server.
    Vllm,
    /// SGLang's server.
    Sglang,
    /// llama.cpp's `llama-server`.
    Llamacpp,
    /// Hugging Face Text Generation Inference.
    Tgi,
    /// Any other OpenAI-compatible server (health at `/health`, no load metrics).
    Openai,
}

impl EngineKind {
    /// The engine's name as configured.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Switchyard => "switchyard",
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Llamacpp => "llamacpp",
            EngineKind::Tgi => "tgi",
            EngineKind::Openai => "openai",
        }
    }
}

/// `[[workers]]`: one worker reachable over HTTP.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// A unique name (metrics label); defaults to the URL's authority.
    #[serde(default)]
    pub name: Option<String>,
    /// Base URL, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// The model it serves.
    pub model: String,
    /// What it does.
    #[serde(default)]
    pub role: Role,
    /// Tokens per KV block.
    #[serde(default = "super::default_block_size")]
    pub block_size: usize,
    /// Capabilities, e.g. `text`, `image`, `audio`.
    #[serde(default = "default_capabilities")]
    pub capabilities: Vec<String>,
    /// Relative cost of a token on this worker (spot < reserved).
    #[serde(default = "default_cost")]
    pub cost: f64,
    /// Total KV blocks of the worker (0: unknown).
    #[serde(default)]
    pub capacity_blocks: u64,
    /// The machine it runs on (same-node encoder → LLM transfers are faster); empty: unknown.
    #[serde(default)]
    pub node: String,
    /// Encoders: the token budgets it batches to, ascending.
    #[serde(default)]
    pub token_budgets: Vec<u32>,
    /// Spot (preemptible) capacity: it may be reclaimed at any moment; its reclaim notice
    /// (a registration with `preempting`) takes it out of routing at once.
    #[serde(default)]
    pub spot: bool,
    /// Its engine (`switchyard`, `vllm`, `sglang`, `llamacpp`, `tgi`, `openai`); unset, the
    /// gateway tells from the worker's answers and logs what it found.
    #[serde(default)]
    pub engine: Option<EngineKind>,
    /// Where its health is checked, in place of its engine's (`/healthz` for Switchyard's
    /// workers, `/health` for every other engine).
    #[serde(default)]
    pub health_path: Option<String>,
}

fn default_capabilities() -> Vec<String> {
    vec!["text".into()]
}

fn default_cost() -> f64 {
    1.0
}

impl WorkerConfig {
    /// The worker's name: its configured name or its URL's authority.
    pub fn display_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            self.url
                .parse::<http::Uri>()
                .ok()
                .and_then(|uri| uri.authority().map(|a| a.to_string()))
                .unwrap_or_else(|| self.url.clone())
        })
    }
}

impl HealthConfig {
    /// Refuses intervals, timeouts and counts of 0.
    pub(super) fn check(&self) -> Checked {
        positive(&[
            ("health.interval_ms", self.interval_ms),
            ("health.timeout_ms", self.timeout_ms),
            ("health.failures_to_eject", u64::from(self.failures_to_eject)),
            ("health.successes_to_restore", u64::from(self.successes_to_restore)),
        ])
    }
}

impl ForwardingConfig {
    /// Refuses timeouts, counts and backoffs of 0, and a longest backoff below the first.
    pub(super) fn check(&self) -> Checked {
        positive(&[
            ("forwarding.connect_timeout_ms", self.connect_timeout_ms),
            ("forwarding.response_timeout_ms", self.response_timeout_ms),
            ("forwarding.errors_to_eject", u64::from(self.errors_to_eject)),
            ("forwarding.breaker_open_ms", self.breaker_open_ms),
            ("forwarding.busy_backoff_ms", self.busy_backoff_ms),
            ("forwarding.prefill_timeout_ms", self.prefill_timeout_ms),
        ])?;
        for (key, max, first) in [
            (
                "forwarding.breaker_open_max_ms",
                self.breaker_open_max_ms,
                self.breaker_open_ms,
            ),
            (
                "forwarding.busy_backoff_max_ms",
                self.busy_backoff_max_ms,
                self.busy_backoff_ms,
            ),
        ] {
            if max < first {
                return Err(Invalid::new(key, format!("{max} is below the first backoff, {first}")));
            }
        }
        Ok(())
    }
}

impl EmbeddedMockers {
    /// Refuses an engine without a model, sizes of 0, and speeds and costs that are not
    /// positive numbers (a spot cost may be 0); and any mocker at all in a gateway built
    /// without them.
    pub(super) fn check(&self) -> Checked {
        #[cfg(not(feature = "embedded-mockers"))]
        if self.count > 0 {
            return Err(Invalid::new(
                "embedded_mockers.count",
                "this gateway was built without the `embedded-mockers` feature; set `count = 0` or rebuild with it",
            ));
        }
        if self.model.is_empty() {
            return Err(Invalid::new("embedded_mockers.model", "must not be empty"));
        }
        positive(&[
            ("embedded_mockers.block_size", self.block_size as u64),
            ("embedded_mockers.num_gpu_blocks", self.num_gpu_blocks as u64),
            (
                "embedded_mockers.max_num_batched_tokens",
                self.max_num_batched_tokens as u64,
            ),
            ("embedded_mockers.max_num_seqs", self.max_num_seqs as u64),
        ])?;
        for (key, value) in [
            ("embedded_mockers.speedup", self.speedup),
            ("embedded_mockers.encoder_cost_scale", self.encoder_cost_scale),
            ("embedded_mockers.spot_speed", self.spot_speed),
            ("embedded_mockers.kv_link_gbps", self.kv_link_gbps),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(Invalid::new(key, format!("must be a positive number, got {value}")));
            }
        }
        if !(self.spot_cost.is_finite() && self.spot_cost >= 0.0) {
            return Err(Invalid::new(
                "embedded_mockers.spot_cost",
                format!("must be a number of at least 0, got {}", self.spot_cost),
            ));
        }
        Ok(())
    }
}

/// Checks every `[[workers]]` entry: an absolute `http://` URL, a model, a block size, a cost,
/// and a name no other entry has.
pub(super) fn check_workers(workers: &[WorkerConfig]) -> Checked {
    let mut names = std::collections::HashSet::new();
    for (index, worker) in workers.iter().enumerate() {
        let key = |field: &str| format!("workers[{index}].{field}");
        let uri: http::Uri = worker
            .url
            .parse()
            .map_err(|err| Invalid::new(key("url"), format!("`{}` is not a URL: {err}", worker.url)))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(Invalid::new(
                key("url"),
                format!(
                    "`{}` must be an absolute `http://host:port` URL (workers are reached over plain HTTP)",
                    worker.url
                ),
            ));
        }
        if worker.model.is_empty() {
            return Err(Invalid::new(key("model"), "must not be empty"));
        }
        if worker.block_size == 0 {
            return Err(Invalid::new(key("block_size"), "must be greater than 0"));
        }
        if !(worker.cost.is_finite() && worker.cost >= 0.0) {
            return Err(Invalid::new(
                key("cost"),
                format!("must be a non-negative number, got {}", worker.cost),
            ));
        }
        if let Some(path) = &worker.health_path
            && (!path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err())
        {
            return Err(Invalid::new(
                key("health_path"),
                format!("`{path}` must be a path starting with `/`, e.g. `/health`"),
            ));
        }
        if !names.insert(worker.display_name()) {
            return Err(Invalid::new(
                key("name"),
                format!("worker name `{}` is used twice", worker.display_name()),
            ));
        }
    }
    Ok(())
}
