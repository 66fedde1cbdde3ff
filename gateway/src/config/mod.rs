//! The gateway's configuration: the TOML schema, its defaults, and validation.
//!
//! This module owns turning a TOML file into a [`Config`] and refusing a bad one with an error
//! that names the file, the key and why ([`ConfigError`]). Unknown keys are errors (a typo must
//! not silently fall back to a default). It does not start anything; `server` and `workers`
//! read the validated values.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

mod admission;
mod fleet;
mod planner;
mod tenants;

pub use admission::AdmissionConfig;
pub use fleet::FleetConfig;
pub use planner::{PlannerConfig, PoolConfig, profiled_rate};

pub use tenants::{ApiKeyConfig, KeysFile, TenantsConfig, validate_key_lists, validate_keys};

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read the config file: {source}")]
    Read {
        /// The config file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML, has an unknown key, or a value of the wrong type.
    #[error("{file}: {message}")]
    Parse {
        /// The config file.
        file: PathBuf,
        /// The parser's message, which quotes the offending line and key.
        message: String,
    },
    /// A value is well-typed but unusable.
    #[error("{file}: key `{key}`: {reason}")]
    Invalid {
        /// The config file.
        file: PathBuf,
        /// The dotted key path, e.g. `workers[2].url`.
        key: String,
        /// Why the value is refused.
        reason: String,
    },
}

/// Whether the gateway runs for development or production.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Development: a self-signed certificate is generated when none is configured.
    #[default]
    Dev,
    /// Production: a certificate (or an explicit `plaintext = true`) is required.
    Production,
}

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `dev` or `production`.
    #[serde(default)]
    pub mode: Mode,
    /// The client-facing listener.
    #[serde(default)]
    pub server: ServerConfig,
    /// Active health checks of workers.
    #[serde(default)]
    pub health: HealthConfig,
    /// How requests are forwarded to workers.
    #[serde(default)]
    pub forwarding: ForwardingConfig,
    /// Simulated workers started inside the gateway process.
    #[serde(default)]
    pub embedded_mockers: Option<EmbeddedMockers>,
    /// Workers reachable over HTTP.
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// The routing policy and its sandbox.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// The admin API (policy management).
    #[serde(default)]
    pub admin: Option<AdminConfig>,
    /// Per-model tokenization and KV block settings.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// KV-aware routing: event transports, replicas, adapters.
    #[serde(default)]
    pub kv: KvConfig,
    /// Media in requests: where it may come from and how large it may be.
    #[serde(default)]
    pub media: MediaConfig,
    /// How the gateway batches media for encoders and what it does when they fail.
    #[serde(default)]
    pub encoders: EncodersConfig,
    /// The fleet of gateway replicas this one shares its router policy with.
    #[serde(default)]
    pub fleet: Option<FleetConfig>,
    /// The admission queue in front of full workers.
    #[serde(default)]
    pub admission: Option<AdmissionConfig>,
    /// The planner that sizes worker pools.
    #[serde(default)]
    pub planner: Option<PlannerConfig>,
    /// Where API keys and tenants' usage live outside this file.
    #[serde(default)]
    pub tenants: TenantsConfig,
    /// Client keys; with none here and no `tenants.keys_file`, the gateway is open to any
    /// client that reaches it.
    #[serde(default)]
    pub api_keys: Vec<ApiKeyConfig>,
}

/// `[encoders]`: the gateway's queue in front of each encoder worker (role `vision` or
/// `audio`), and how long an encode may take.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EncodersConfig {
    /// Most items in one micro-batch.
    pub max_items: usize,
    /// A batch is sent at the latest this long after its first item arrived.
    pub deadline_ms: u64,
    /// How long one encode (queue, forward pass, delivery) may take before it is retried
    /// elsewhere.
    pub timeout_ms: u64,
    /// Send the LLM request only once the media is encoded, instead of at once (the
    /// baseline that encode/prefill overlap is measured against).
    pub blocking: bool,
    /// No encoder pool: each LLM worker encodes its requests' media itself, on its own
    /// device, one item at a time (the deployment encoder pools are measured against).
    pub local: bool,
    /// The batching policy at every encoder queue: a built-in (`mixed-modality`, `fcfs`,
    /// `token-budget`) or a path to a `.wasm` exporting the `batcher` world.
    pub batcher: String,
    /// Most batches one flush of a queue forms (the rest wait for the next flush).
    pub max_batches: u32,
    /// The batcher's own settings, readable through the host world's `config.get`.
    pub batcher_config: toml::Table,
}

impl Default for EncodersConfig {
    fn default() -> EncodersConfig {
        EncodersConfig {
            max_items: 8,
            deadline_ms: 5,
            timeout_ms: 10_000,
            blocking: false,
            local: false,
            batcher: "mixed-modality".into(),
            max_batches: 4,
            batcher_config: toml::Table::new(),
        }
    }
}

/// `[media]`: limits on the media parts of chat requests (images, audio, video), checked from
/// their headers before any worker is involved.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MediaConfig {
    /// Fetch `http(s)` media URLs. Off by default: only `data:` URLs are accepted.
    pub fetch: bool,
    /// Hosts media may be fetched from when `fetch` is on (empty: none).
    pub allow_hosts: Vec<String>,
    /// Fetch from private, loopback and link-local addresses too.
    pub allow_private: bool,
    /// Largest media item, in bytes (after base64 decoding).
    pub max_bytes: usize,
    /// Largest image or video frame, in pixels.
    pub max_pixels: u64,
    /// Longest audio or video, in seconds.
    pub max_duration_s: f64,
    /// Most media items in one request.
    pub max_items: usize,
    /// How long one URL fetch may take.
    pub fetch_timeout_ms: u64,
    /// Extra CA certificates (PEM) trusted for `https` media URLs, beside the Mozilla roots.
    pub fetch_ca_file: Option<PathBuf>,
}

impl Default for MediaConfig {
    fn default() -> MediaConfig {
        let limits = switchyard_media::MediaLimits::default();
        MediaConfig {
            fetch: false,
            allow_hosts: Vec::new(),
            allow_private: false,
            max_bytes: limits.max_bytes,
            max_pixels: limits.max_pixels,
            max_duration_s: limits.max_duration_s,
            max_items: 16,
            fetch_timeout_ms: 5_000,
            fetch_ca_file: None,
        }
    }
}

impl MediaConfig {
    /// The header limits these settings give.
    pub fn limits(&self) -> switchyard_media::MediaLimits {
        switchyard_media::MediaLimits {
            max_bytes: self.max_bytes,
            max_pixels: self.max_pixels,
            max_duration_s: self.max_duration_s,
            ..switchyard_media::MediaLimits::default()
        }
    }
}

/// `[[models]]`: how a model's prompts are tokenized and cut into KV blocks.
///
/// A model without an entry uses the byte-level fallback tokenizer, the default chat template,
/// and the block size of its embedded mockers (or of its first configured worker).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model name requests use.
    pub name: String,
    /// Tokens per KV block; workers registering another size are reported and not indexed.
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// A Hugging Face `tokenizer.json`; the byte-level fallback when absent.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// The chat template (see `switchyard_tokenize::ChatTemplate`).
    #[serde(default)]
    pub chat_template: Option<ChatTemplateConfig>,
    /// A LoRA adapter name that salts the model's block hashes.
    #[serde(default)]
    pub lora: Option<String>,
    /// The model's context length: prompt, media and answer together.
    #[serde(default = "default_max_model_len")]
    pub max_model_len: u32,
    /// Longest prompt accepted, in tokens (default: `max_model_len`; a model without a
    /// `[[models]]` entry has no limit but the body size). A longer one is answered 400; one
    /// whose text is over 64 bytes per allowed token is refused before it is even tokenized.
    #[serde(default)]
    pub max_prompt_tokens: Option<u32>,
    /// The model's time-to-first-token target in milliseconds, for requests that do not send
    /// `x-switchyard-ttft-ms`: what routers see and attainment is measured against.
    #[serde(default)]
    pub ttft_target_ms: Option<f32>,
    /// The model's inter-token latency target in milliseconds, for requests that do not send
    /// `x-switchyard-itl-ms`.
    #[serde(default)]
    pub itl_target_ms: Option<f32>,
    /// How the model turns media into tokens (`[models.media]`: patch size, merge factor,
    /// frame sampling, budgets; see `switchyard_media::ModelMedia`).
    #[serde(default)]
    pub media: switchyard_media::ModelMedia,
}

/// `[models.chat_template]`: `message` with `{role}` and `{content}`, then `generation_prompt`;
/// or `file`, the model's own Jinja template (its `tokenizer_config.json` or a `.jinja` file).
/// Workers must render prompts alike for block hashes to agree.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatTemplateConfig {
    /// Written once per message.
    #[serde(default)]
    pub message: Option<String>,
    /// Written after the last message.
    #[serde(default)]
    pub generation_prompt: String,
    /// A Jinja chat template file (instead of `message`).
    #[serde(default)]
    pub file: Option<PathBuf>,
}

/// `[kv]`: where KV events, registrations and heartbeats come from.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    /// A NATS server (`nats://host:4222`) for distributed workers and gateway replicas.
    pub nats_url: Option<String>,
    /// The prefix of every NATS subject.
    pub subject_prefix: String,
    /// Share active sequences with the other gateways on the same NATS.
    pub replica_sync: bool,
    /// Heartbeats a registered worker may miss before it leaves the index and the rotation.
    pub heartbeat_misses: u32,
    /// Events buffered per worker while its resync dump is awaited.
    pub resync_buffer: usize,
    /// How long a resync dump is awaited, in milliseconds.
    pub resync_timeout_ms: u64,
    /// vLLM workers whose ZMQ KV event stream is consumed.
    pub vllm: Vec<VllmEventsConfig>,
}

impl Default for KvConfig {
    fn default() -> KvConfig {
        KvConfig {
            nats_url: None,
            subject_prefix: "switchyard".into(),
            replica_sync: false,
            heartbeat_misses: 3,
            resync_buffer: 10_000,
            resync_timeout_ms: 2_000,
            vllm: Vec::new(),
        }
    }
}

/// `[[kv.vllm]]`: a vLLM worker's KV event publisher.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmEventsConfig {
    /// The `[[workers]]` entry (by name) the events describe.
    pub worker: String,
    /// Its ZMQ PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The ZMQ topic to subscribe to (empty: all).
    #[serde(default)]
    pub topic: String,
}

/// `[policy]`: the router policy (a Wasm component) and its sandbox.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// A built-in policy (`round-robin`, `least-load`, `kv-aware`, `predicted-ttft`,
    /// `modality-aware`) or a path to a `.wasm`.
    pub router: String,
    /// CPU time one policy call may take, in milliseconds.
    pub deadline_ms: u64,
    /// Linear memory one policy instance may use, in MiB.
    pub memory_limit_mib: usize,
    /// Failures of one version after which the previous version is restored.
    pub max_failures: u32,
    /// Where compiled policy code is cached (keyed by sha256 and engine); none disables it.
    pub cache_dir: Option<PathBuf>,
    /// Instance slots of the policy sandbox (every thread that calls a policy keeps up to four
    /// instances); absent, sized from the machine's threads (at least 256). A call that finds
    /// no slot is served by the fallback and never counts against the policy.
    pub max_instances: Option<u32>,
    /// A directory whose `NAME.wasm` files are published as they are written.
    pub watch_dir: Option<PathBuf>,
    /// The policy's own settings, readable through the host world's `config.get`.
    pub config: toml::Table,
}

impl Default for PolicyConfig {
    fn default() -> PolicyConfig {
        PolicyConfig {
            router: "kv-aware".into(),
            deadline_ms: 1,
            memory_limit_mib: 32,
            max_failures: 5,
            cache_dir: None,
            max_instances: None,
            watch_dir: None,
            config: toml::Table::new(),
        }
    }
}

/// `[admin]`: the admin API on its own listener.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address of the admin listener (plain HTTP unless `tls` is set; keep it on a private
    /// interface either way).
    pub listen: SocketAddr,
    /// Bearer token every admin request must carry; absent (dev mode only), one is generated
    /// at start and printed with the ready line.
    #[serde(default)]
    pub token: Option<String>,
    /// `[admin.tls]`: serve the admin API over TLS, optionally requiring client certificates.
    #[serde(default)]
    pub tls: Option<AdminTlsConfig>,
}

/// `[admin.tls]`: the admin listener's certificate, and the CA its clients' certificates must
/// chain to (mTLS; the bearer token is still required).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminTlsConfig {
    /// Certificate chain, leaf first (PEM).
    pub cert: PathBuf,
    /// Private key (PEM).
    pub key: PathBuf,
    /// CA certificates (PEM) a client certificate must chain to; absent: no client
    /// certificate is asked for.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

impl AdminTlsConfig {
    /// The certificate and key, as the client listener's are configured.
    pub fn pair(&self) -> TlsConfig {
        TlsConfig {
            cert: self.cert.clone(),
            key: self.key.clone(),
        }
    }
}

/// Largest `server.stream_coalesce_us`.
const MAX_STREAM_COALESCE_US: u64 = 100_000;

/// `[server]`: the client-facing listener and its limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Serve plain HTTP instead of TLS. Must be set explicitly.
    pub plaintext: bool,
    /// Certificate and key; absent in dev mode means a generated self-signed certificate.
    pub tls: Option<TlsConfig>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Largest request head (request line and headers), in bytes.
    pub max_header_bytes: usize,
    /// Time allowed for a new connection's first request head to arrive.
    pub header_read_timeout_ms: u64,
    /// Time a connection may sit idle between requests (HTTP/1.1 keep-alive, HTTP/2 pings).
    pub idle_timeout_ms: u64,
    /// Time allowed for the TLS handshake.
    pub tls_handshake_timeout_ms: u64,
    /// On SIGTERM or ctrl-c: time the responses in flight (streams included) get to finish
    /// before the gateway exits anyway.
    pub drain_timeout_ms: u64,
    /// Client connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// A streamed answer's events that arrive within this many microseconds of its last write
    /// to the client wait for the window to end and are written together (0: every event at
    /// once). An event that opens a write waits, at most this long, only for the events
    /// upstream read with it (a few microseconds when there are none); the stream's first
    /// bytes are never held.
    pub stream_coalesce_us: u64,
    /// Serve `/metrics` on this listener. Turn it off to serve them only on the admin
    /// listener (`GET /metrics` there, with the admin token), off the public port.
    pub metrics: bool,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8443)),
            plaintext: false,
            tls: None,
            max_body_bytes: 32 << 20,
            max_header_bytes: 64 << 10,
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 120_000,
            tls_handshake_timeout_ms: 10_000,
            drain_timeout_ms: 30_000,
            max_connections: 10_000,
            stream_coalesce_us: 1_000,
            metrics: true,
        }
    }
}

/// `[server.tls]`: PEM files.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain, leaf first (PEM).
    pub cert: PathBuf,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

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
    /// Other workers tried when one fails before its first byte.
    pub retries: u32,
    /// Consecutive failed answers (5xx, or a stream that broke before its first byte) that take
    /// a worker out of rotation until its health check passes again.
    pub errors_to_eject: u32,
}

impl Default for ForwardingConfig {
    fn default() -> ForwardingConfig {
        ForwardingConfig {
            connect_timeout_ms: 2_000,
            response_timeout_ms: 300_000,
            pool_max_idle_per_worker: 256,
            retries: 1,
            errors_to_eject: 3,
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
        }
    }
}

pub use switchyard_protocol::Role;

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
    #[serde(default = "default_block_size")]
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
}

fn default_block_size() -> usize {
    64
}

fn default_max_model_len() -> u32 {
    ModelConfig::DEFAULT_MAX_MODEL_LEN
}

impl ModelConfig {
    /// The context length of a model without `max_model_len`.
    pub const DEFAULT_MAX_MODEL_LEN: u32 = 32_768;
}

fn default_capabilities() -> Vec<String> {
    vec!["text".into()]
}

fn default_cost() -> f64 {
    1.0
}

impl Config {
    /// Reads and validates a configuration file.
    ///
    /// # Errors
    ///
    /// Returns [`ConfigError`] naming the file (and the key, where there is one) if the file
    /// cannot be read, is not valid TOML for this schema, or holds an unusable value.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// Parses and validates configuration text; `file` is only used in error messages.
    ///
    /// # Errors
    ///
    /// As for [`Config::load`].
    pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|err| ConfigError::Parse {
            file: file.to_path_buf(),
            message: err.to_string(),
        })?;
        config.validate(file)?;
        Ok(config)
    }

    /// Checks every value a parser cannot: ranges, URLs, files, uniqueness.
    ///
    /// # Errors
    ///
    /// Returns [`ConfigError::Invalid`] for the first unusable value.
    pub fn validate(&self, file: &Path) -> Result<(), ConfigError> {
        let invalid = |key: &str, reason: String| ConfigError::Invalid {
            file: file.to_path_buf(),
            key: key.to_string(),
            reason,
        };
        let server = &self.server;
        if server.plaintext && server.tls.is_some() {
            return Err(invalid(
                "server.plaintext",
                "`plaintext = true` conflicts with `[server.tls]`; choose one".into(),
            ));
        }
        if self.mode == Mode::Production && !server.plaintext && server.tls.is_none() {
            return Err(invalid(
                "server.tls",
                "production mode needs a certificate and key (`[server.tls] cert = ..., key = ...`) or an explicit `plaintext = true`".into(),
            ));
        }
        if let Some(tls) = &server.tls {
            for (key, path) in [("server.tls.cert", &tls.cert), ("server.tls.key", &tls.key)] {
                if !path.is_file() {
                    return Err(invalid(key, format!("file `{}` does not exist", path.display())));
                }
            }
        }
        for (key, value) in [
            ("server.max_body_bytes", server.max_body_bytes as u64),
            ("server.max_header_bytes", server.max_header_bytes as u64),
            ("server.header_read_timeout_ms", server.header_read_timeout_ms),
            ("server.idle_timeout_ms", server.idle_timeout_ms),
            ("server.tls_handshake_timeout_ms", server.tls_handshake_timeout_ms),
            ("health.interval_ms", self.health.interval_ms),
            ("health.timeout_ms", self.health.timeout_ms),
            ("health.failures_to_eject", u64::from(self.health.failures_to_eject)),
            (
                "health.successes_to_restore",
                u64::from(self.health.successes_to_restore),
            ),
            ("forwarding.connect_timeout_ms", self.forwarding.connect_timeout_ms),
            ("forwarding.response_timeout_ms", self.forwarding.response_timeout_ms),
            ("encoders.max_items", self.encoders.max_items as u64),
            ("encoders.timeout_ms", self.encoders.timeout_ms),
            ("encoders.max_batches", u64::from(self.encoders.max_batches)),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0".into()));
            }
        }
        if server.max_header_bytes < 8192 {
            return Err(invalid(
                "server.max_header_bytes",
                "must be at least 8192 (hyper's minimum read buffer)".into(),
            ));
        }
        #[cfg(not(feature = "embedded-mockers"))]
        if self.embedded_mockers.as_ref().is_some_and(|m| m.count > 0) {
            return Err(invalid(
                "embedded_mockers.count",
                "this gateway was built without the `embedded-mockers` feature; set `count = 0` or rebuild with it"
                    .into(),
            ));
        }
        if let Some(mockers) = &self.embedded_mockers {
            if mockers.model.is_empty() {
                return Err(invalid("embedded_mockers.model", "must not be empty".into()));
            }
            for (key, value) in [
                ("embedded_mockers.block_size", mockers.block_size),
                ("embedded_mockers.num_gpu_blocks", mockers.num_gpu_blocks),
                (
                    "embedded_mockers.max_num_batched_tokens",
                    mockers.max_num_batched_tokens,
                ),
                ("embedded_mockers.max_num_seqs", mockers.max_num_seqs),
            ] {
                if value == 0 {
                    return Err(invalid(key, "must be greater than 0".into()));
                }
            }
            for (key, value) in [
                ("embedded_mockers.speedup", mockers.speedup),
                ("embedded_mockers.encoder_cost_scale", mockers.encoder_cost_scale),
                ("embedded_mockers.spot_speed", mockers.spot_speed),
            ] {
                if !(value.is_finite() && value > 0.0) {
                    return Err(invalid(key, format!("must be a positive number, got {value}")));
                }
            }
            if !(mockers.spot_cost.is_finite() && mockers.spot_cost >= 0.0) {
                return Err(invalid(
                    "embedded_mockers.spot_cost",
                    format!("must be a number of at least 0, got {}", mockers.spot_cost),
                ));
            }
        }
        type BuiltIn = fn(&str) -> Result<&'static [u8], crate::policy::PolicyError>;
        let policies: [(&str, &str, BuiltIn); 2] = [
            ("policy.router", &self.policy.router, crate::policy::built_in_router),
            (
                "encoders.batcher",
                &self.encoders.batcher,
                crate::policy::built_in_batcher,
            ),
        ];
        for (key, name, built_in) in policies {
            if name.ends_with(".wasm") {
                continue;
            }
            if let Err(err) = built_in(name) {
                return Err(invalid(
                    key,
                    format!("must name a built-in policy or a .wasm file: {err}"),
                ));
            }
        }
        if !self.server.metrics && self.admin.is_none() {
            return Err(invalid(
                "server.metrics",
                "is false, so /metrics would be served nowhere: add an [admin] listener (it serves them) or set it true".into(),
            ));
        }
        if self.server.stream_coalesce_us > MAX_STREAM_COALESCE_US {
            return Err(invalid(
                "server.stream_coalesce_us",
                format!("must be at most {MAX_STREAM_COALESCE_US} (100 ms): it delays the events it holds"),
            ));
        }
        if self.server.max_connections == 0 {
            return Err(invalid("server.max_connections", "must be greater than 0".into()));
        }
        if self.forwarding.errors_to_eject == 0 {
            return Err(invalid("forwarding.errors_to_eject", "must be greater than 0".into()));
        }
        if self.policy.deadline_ms == 0
            || self.policy.memory_limit_mib == 0
            || self.policy.max_failures == 0
            || self.policy.max_instances == Some(0)
        {
            let key = if self.policy.deadline_ms == 0 {
                "policy.deadline_ms"
            } else if self.policy.memory_limit_mib == 0 {
                "policy.memory_limit_mib"
            } else if self.policy.max_failures == 0 {
                "policy.max_failures"
            } else {
                "policy.max_instances"
            };
            return Err(invalid(key, "must be greater than 0".into()));
        }
        if let Some(dir) = &self.policy.watch_dir
            && !dir.is_dir()
        {
            return Err(invalid(
                "policy.watch_dir",
                format!("`{}` is not a directory", dir.display()),
            ));
        }
        if let Some(admin) = &self.admin {
            match &admin.token {
                Some(token) if token.len() < 16 => {
                    return Err(invalid("admin.token", "must be at least 16 characters".into()));
                }
                None if self.mode != Mode::Dev => {
                    return Err(invalid(
                        "admin.token",
                        "is required outside `mode = \"dev\"` (in dev mode one is generated at start and printed)"
                            .into(),
                    ));
                }
                _ => {}
            }
        }
        let mut names = std::collections::HashSet::new();
        for (index, worker) in self.workers.iter().enumerate() {
            let key = |field: &str| format!("workers[{index}].{field}");
            let uri: http::Uri = worker
                .url
                .parse()
                .map_err(|err| invalid(&key("url"), format!("`{}` is not a URL: {err}", worker.url)))?;
            if uri.scheme_str() != Some("http") || uri.authority().is_none() {
                return Err(invalid(
                    &key("url"),
                    format!(
                        "`{}` must be an absolute `http://host:port` URL (workers are reached over plain HTTP)",
                        worker.url
                    ),
                ));
            }
            if worker.model.is_empty() {
                return Err(invalid(&key("model"), "must not be empty".into()));
            }
            if worker.block_size == 0 {
                return Err(invalid(&key("block_size"), "must be greater than 0".into()));
            }
            if !(worker.cost.is_finite() && worker.cost >= 0.0) {
                return Err(invalid(
                    &key("cost"),
                    format!("must be a non-negative number, got {}", worker.cost),
                ));
            }
            if !names.insert(worker.display_name()) {
                return Err(invalid(
                    &key("name"),
                    format!("worker name `{}` is used twice", worker.display_name()),
                ));
            }
        }
        if self.workers.is_empty()
            && self.embedded_mockers.as_ref().is_none_or(|m| m.count == 0)
            && self.kv.nats_url.is_none()
            && self.admin.is_none()
        {
            return Err(invalid(
                "workers",
                "no workers configured: add `[[workers]]` entries, `[embedded_mockers] count = N`, or, for workers that register themselves, `[kv] nats_url` or `[admin]`".into(),
            ));
        }
        let media = &self.media;
        if let Some(path) = media.fetch_ca_file.as_ref().filter(|_| media.fetch)
            && !path.is_file()
        {
            return Err(invalid(
                "media.fetch_ca_file",
                format!("`{}` is not a readable file", path.display()),
            ));
        }
        if media.fetch && media.allow_hosts.is_empty() {
            return Err(invalid(
                "media.allow_hosts",
                "`fetch = true` needs the hosts media may be fetched from (e.g. [\"images.example.com\", \"*.cdn.example.net\"])".into(),
            ));
        }
        for (key, zero) in [
            ("media.max_bytes", media.max_bytes == 0),
            ("media.max_pixels", media.max_pixels == 0),
            ("media.max_items", media.max_items == 0),
            ("media.fetch_timeout_ms", media.fetch_timeout_ms == 0),
            (
                "media.max_duration_s",
                !media.max_duration_s.is_finite() || media.max_duration_s <= 0.0,
            ),
        ] {
            if zero {
                return Err(invalid(key, "must be greater than 0".into()));
            }
        }
        let mut models = std::collections::HashSet::new();
        for (index, model) in self.models.iter().enumerate() {
            let key = |field: &str| format!("models[{index}].{field}");
            if model.name.is_empty() {
                return Err(invalid(&key("name"), "must not be empty".into()));
            }
            if !models.insert(model.name.as_str()) {
                return Err(invalid(&key("name"), format!("model `{}` is listed twice", model.name)));
            }
            if model.block_size == 0 {
                return Err(invalid(&key("block_size"), "must be greater than 0".into()));
            }
            if model.max_model_len == 0 {
                return Err(invalid(&key("max_model_len"), "must be greater than 0".into()));
            }
            if let Err(err) = model.media.validate() {
                return Err(invalid(&key("media"), err.to_string()));
            }
            if let Some(path) = &model.tokenizer
                && !path.is_file()
            {
                return Err(invalid(
                    &key("tokenizer"),
                    format!("file `{}` does not exist", path.display()),
                ));
            }
            if let Some(template) = &model.chat_template {
                match (&template.message, &template.file) {
                    (Some(_), Some(_)) => {
                        return Err(invalid(
                            &key("chat_template"),
                            "give `message` or `file`, not both".into(),
                        ));
                    }
                    (None, None) => {
                        return Err(invalid(
                            &key("chat_template"),
                            "needs `message` (a pattern) or `file` (a Jinja template)".into(),
                        ));
                    }
                    (None, Some(path)) => {
                        if let Err(err) = switchyard_tokenize::JinjaTemplate::from_file(path) {
                            return Err(invalid(&key("chat_template.file"), err.to_string()));
                        }
                    }
                    (Some(_), None) => {}
                }
            }
        }
        let kv = &self.kv;
        if let Some(url) = &kv.nats_url
            && !(url.starts_with("nats://") || url.starts_with("tls://"))
        {
            return Err(invalid(
                "kv.nats_url",
                format!("`{url}` must be a `nats://host:port` (or `tls://`) URL"),
            ));
        }
        if kv.subject_prefix.is_empty()
            || kv
                .subject_prefix
                .split('.')
                .any(|token| !switchyard_protocol::kv_events::valid_worker_name(token))
        {
            return Err(invalid(
                "kv.subject_prefix",
                format!(
                    "`{}` must be dot-separated tokens of letters, digits, `-` and `_`",
                    kv.subject_prefix
                ),
            ));
        }
        if kv.replica_sync && kv.nats_url.is_none() {
            return Err(invalid("kv.replica_sync", "needs `kv.nats_url`".into()));
        }
        for (key, value) in [
            ("kv.heartbeat_misses", u64::from(kv.heartbeat_misses)),
            ("kv.resync_buffer", kv.resync_buffer as u64),
            ("kv.resync_timeout_ms", kv.resync_timeout_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0".into()));
            }
        }
        for (index, model) in self.models.iter().enumerate() {
            for (key, value) in [
                ("ttft_target_ms", model.ttft_target_ms),
                ("itl_target_ms", model.itl_target_ms),
            ] {
                if let Some(value) = value
                    && !(value.is_finite() && value > 0.0)
                {
                    return Err(invalid(
                        &format!("models[{index}].{key}"),
                        format!("{value}: a target is a positive number of milliseconds"),
                    ));
                }
            }
        }
        validate_keys(&self.api_keys).map_err(|(key, reason)| invalid(&key, reason))?;
        if let Some(admission) = &self.admission {
            admission.check().map_err(|(key, reason)| invalid(key, reason))?;
        }
        if let Some(fleet) = &self.fleet {
            fleet.check().map_err(|(key, reason)| invalid(key, reason))?;
        }
        if let Some(planner) = &self.planner {
            planner.check().map_err(|(key, reason)| invalid(&key, reason))?;
        }
        if let Some(path) = &self.tenants.keys_file
            && !path.is_file()
        {
            return Err(invalid(
                "tenants.keys_file",
                format!("file `{}` does not exist", path.display()),
            ));
        }
        for (index, vllm) in kv.vllm.iter().enumerate() {
            if !self.workers.iter().any(|w| w.display_name() == vllm.worker) {
                return Err(invalid(
                    &format!("kv.vllm[{index}].worker"),
                    format!("no `[[workers]]` entry is named `{}`", vllm.worker),
                ));
            }
            if !vllm.endpoint.starts_with("tcp://") && !vllm.endpoint.starts_with("ipc://") {
                return Err(invalid(
                    &format!("kv.vllm[{index}].endpoint"),
                    format!(
                        "`{}` must be a `tcp://host:port` or `ipc://` ZMQ endpoint",
                        vllm.endpoint
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl ServerConfig {
    /// [`ServerConfig::header_read_timeout_ms`] as a duration.
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }

    /// [`ServerConfig::idle_timeout_ms`] as a duration.
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }

    /// [`ServerConfig::tls_handshake_timeout_ms`] as a duration.
    pub fn tls_handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.tls_handshake_timeout_ms)
    }

    /// [`ServerConfig::drain_timeout_ms`] as a duration.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }

    /// [`ServerConfig::stream_coalesce_us`] as a duration.
    pub fn stream_coalesce(&self) -> Duration {
        Duration::from_micros(self.stream_coalesce_us)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("test.toml"))
    }

    #[test]
    fn the_embedded_default_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/dev.toml");
        let config = Config::load(&path).expect("config/dev.toml is valid");
        assert_eq!(config.embedded_mockers.map(|m| m.count), Some(4));
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = parse("[server]\nlisten = \"127.0.0.1:1\"\nmax_body = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("test.toml:"), "{err}");
        assert!(err.contains("max_body"), "{err}");
    }

    #[test]
    fn chat_templates_are_a_pattern_or_a_jinja_file() {
        let base = "[embedded_mockers]\ncount = 1\n[[models]]\nname = \"m\"\n[models.chat_template]\n";
        let both = format!("{base}message = \"{{content}}\"\nfile = \"t.jinja\"\n");
        let err = parse(&both).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key, .. } if key == "models[0].chat_template"),
            "{err}"
        );
        let missing = format!("{base}file = \"/nonexistent/tokenizer_config.json\"\n");
        let err = parse(&missing).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key, .. } if key == "models[0].chat_template.file"),
            "{err}"
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("chat.jinja");
        std::fs::write(&path, "{% for m in messages %}{{ m['content'] }}{% endfor %}").expect("write");
        let good = format!("{base}file = \"{}\"\n", path.display());
        assert!(parse(&good).is_ok());
        assert!(parse(&format!("{base}generation_prompt = \"x\"\n")).is_err(), "neither");
    }

    #[test]
    fn a_coalescing_window_past_100_ms_is_refused() {
        let base = "[embedded_mockers]\ncount = 1\n[server]\n";
        let err = parse(&format!("{base}stream_coalesce_us = 100001\n")).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key, .. } if key == "server.stream_coalesce_us"),
            "{err}"
        );
        let config = parse(&format!("{base}stream_coalesce_us = 0\n")).expect("0 turns it off");
        assert!(config.server.stream_coalesce().is_zero());
    }

    #[test]
    fn wrong_types_are_named() {
        let err = parse("[server]\nlisten = 42\n").unwrap_err().to_string();
        assert!(err.contains("listen"), "{err}");
    }

    #[test]
    fn bad_values_name_the_key() {
        let err = parse("[[workers]]\nurl = \"ftp://x\"\nmodel = \"m\"\n").unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { key, .. } if key == "workers[0].url"),
            "{err}"
        );
        let err = parse("[embedded_mockers]\ncount = 1\nspeedup = -1.0\n").unwrap_err();
        assert!(err.to_string().contains("embedded_mockers.speedup"), "{err}");
        let err = parse("[embedded_mockers]\nspot_count = 2\nspot_speed = 0\n").unwrap_err();
        assert!(err.to_string().contains("embedded_mockers.spot_speed"), "{err}");
        let err = parse("[embedded_mockers]\ncount = 1\n[[models]]\nname = \"m\"\nttft_target_ms = -5\n").unwrap_err();
        assert!(err.to_string().contains("models[0].ttft_target_ms"), "{err}");
        let err = parse("[embedded_mockers]\ncount = 1\n[admission]\nbatcher = \"fcfs\"\n").unwrap_err();
        assert!(err.to_string().contains("key `admission`"), "{err}");
        let err = parse("[embedded_mockers]\ncount = 1\n[fleet]\nnats_url = \"http://x\"\n").unwrap_err();
        assert!(err.to_string().contains("fleet.nats_url"), "{err}");
        let err = parse("mode = \"production\"\n[embedded_mockers]\n").unwrap_err();
        assert!(err.to_string().contains("server.tls"), "{err}");
        let err = parse("").unwrap_err();
        assert!(err.to_string().contains("no workers configured"), "{err}");
        let err = parse("[server]\nmax_body_bytes = 0\n[embedded_mockers]\n").unwrap_err();
        assert!(err.to_string().contains("server.max_body_bytes"), "{err}");
    }

    #[test]
    fn duplicate_worker_names_are_refused() {
        let err = parse(
            "[[workers]]\nurl = \"http://a:1\"\nmodel = \"m\"\n[[workers]]\nurl = \"http://a:1\"\nmodel = \"m\"\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("workers[1].name"), "{err}");
    }
}
