//! Switchyard: a TLS gateway that speaks the OpenAI API and routes each request to a worker.
//!
//! The public API is small: [`Gateway::start`] takes a [`Config`] (loaded and validated from
//! TOML), starts any embedded mockers, the event applier, the health checker and the
//! listeners, and returns a handle that keeps them running; [`check_policy`] validates a
//! policy component offline; [`Error`] says why either failed.
//!
//! # A request's path
//!
//! `server::conn` accepts the connection, `server::routes` dispatches by method and path, and
//! `server::pipeline::generate` runs a generation request through its stages, in this order:
//! `admit` (body, model, tenant, targets) → `prepare_prompt` (media inspected, prompt
//! tokenized and hashed) → `enter_admission` (the queue in front of full workers) →
//! `plan_media` (encoders) → `forward` (the attempts: `routing` leases the worker the policy
//! chooses, then its fallbacks) → `finish` (the answer relayed, the tenant charged, the
//! latency judged).
//!
//! # Modules
//!
//! From the request inwards; each module's own documentation says what it owns.
//!
//! | module | owns |
//! |---|---|
//! | `server` | the client listener: connections, TLS, dispatch, and the request path's stages |
//! | `admin` | the admin API on its own listener: policies, rollouts, worker registration, KV inspection, the dashboard |
//! | `state` | what the listeners share ([`Gateway::start`] assembles it, with `start`'s builders) |
//! | `tenants` | API keys, what each may use, rate limits, quotas and usage |
//! | `admission` | the queue that holds requests while every worker of their model is full |
//! | `media` | what the gateway learns of a request's images, audio and video from their headers |
//! | `fetch` | media fetched from `http(s)` URLs (`[media] fetch`) |
//! | `encoders` | the queues in front of encoder workers, and media sent through them |
//! | `routing` | the routing core: which worker serves a request, the worker table its policy reads, and the lease that lasts as long as the answer |
//! | `slo` | latency targets, whether they were met, and the cost served |
//! | `kv` | the prefix index, the active-sequence tracker, and prompts as block hashes |
//! | `events` | where the index and the pool learn what workers cache and who they are (in process, NATS, HTTP, vLLM's ZMQ) |
//! | `workers` | the worker registry, health checks, and the HTTP client to workers |
//! | `policy` | the only module that knows wasmtime: policies as components, their sandbox, versions and rollouts |
//! | `built_ins` | the policies embedded in the binary, by name and world |
//! | `planner` | sizing worker pools by a planner policy, through a connector |
//! | `fleet` | one router policy for every replica of a fleet, in NATS JetStream |
//! | `live` | the dashboard's live figures |
//! | `metrics` | the Prometheus metric families |
//! | `reload` | noticing that loaded files (certificate, keys) changed |
//! | `config` | the TOML schema, its defaults and its checks |
//! | `start` | wiring a gateway from its configuration, one subsystem at a time |
//!
//! [`bench`], [`planning`] and [`fuzzing`] expose what the benchmarks, planner tests and fuzz
//! targets drive directly; they are not a stable API.

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]

mod admin;
mod admission;
mod built_ins;
mod config;
mod encoders;
mod events;
mod fetch;
mod fleet;
mod kv;
mod live;
mod media;
mod metrics;
mod planner;
mod policy;
mod reload;
mod routing;
mod server;
mod slo;
mod start;
mod state;
mod tenants;
mod workers;

pub use config::{Config, ConfigError};
pub use kv::KvSetupError;
pub use policy::PolicyError;
pub use policy::check::{PolicyCheck, check_policy};
pub use policy::runtime::RuntimeConfig as PolicySandbox;
pub use server::tls::TlsError;

/// What the benchmarks and soak tests drive directly: the KV index and the policy runtime.
/// Not a stable API.
#[doc(hidden)]
pub mod bench {
    pub use crate::built_ins::router as built_in_router;
    pub use crate::events::applier::MAX_BATCH;
    pub use crate::kv::index::{IndexSize, KvIndex, Overlap, Overlaps};
    pub use crate::policy::host::{PrefillFit, WorkerTiming};
    pub use crate::policy::runtime::{PolicyRuntime, RuntimeConfig, TimingSource};
    pub use crate::policy::switch::{PolicySwitch, SwitchConfig};
    pub use crate::policy::table;
}

/// What the planner tests drive directly: a planner policy behind the real host (sandbox,
/// answer checks, fallback, rollback) with scripted observations. Not a stable API.
#[doc(hidden)]
pub mod planning {
    pub use crate::built_ins::planner as built_in_planner;
    pub use crate::policy::PolicyError;
    pub use crate::policy::planning::{
        IntervalStats, PlannedBy, PlannerPolicy, PlannerSwitch, Pool, PoolRole, ScaleDecision, validate,
    };
    pub use crate::policy::runtime::{PolicyRuntime, RuntimeConfig};
    pub use crate::policy::switch::SwitchConfig;
}

/// The parsers the fuzz targets under `fuzz/` drive: what takes bytes from clients, workers
/// and policies. Not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::config::{ApiKeyConfig, KeysFile, validate_key_lists};
    pub use crate::events::http::{events as posted_events, registration as posted_registration};
    pub use crate::events::vllm::Translator;
    pub use crate::events::vllm::decode::{BytesHashFold, decode_batch_with};
    pub use crate::kv::index::KvIndex;
    pub use crate::planner::window::Window as PlannerWindow;
    pub use crate::policy::batching::{
        Batch, Budget, PendingTable, fallback as fallback_batches, validate as check_batches,
    };
    pub use crate::policy::planning::{IntervalStats, PoolRole};
    pub use crate::policy::runtime::{Pick, check_route_answer};
    pub use crate::policy::table::{Columns, WorkerTable};

    /// Reads and sizes a request's media under the default `[media]` settings, as the request
    /// path does before routing; answers the number of items.
    ///
    /// # Errors
    ///
    /// The 400 the client would get.
    pub fn inspect_media(
        request: &switchyard_protocol::api::GenerateRequest,
    ) -> Result<usize, switchyard_protocol::api::ApiError> {
        let settings = crate::media::MediaSettings::default();
        let model = settings.model("fuzzed");
        let items = crate::media::inspect(
            request,
            &settings.config,
            &settings.limits,
            &model.media,
            &mut std::collections::HashMap::new(),
        )?;
        Ok(items.len())
    }

    /// A worker's SSE stream after the usage tap, as a tenant's stream is relayed.
    #[derive(Debug)]
    pub struct TappedStream {
        /// What reached the client, the rest of an event never ended included.
        pub out: Vec<u8>,
        /// The usage the tap read, as (prompt, completion) tokens.
        pub usage: Option<(u32, u32)>,
        /// Whether the stream was cut for an event past the limit.
        pub refused: bool,
        /// The most bytes of an event not yet ended the tap held after any frame.
        pub most_held: usize,
    }

    /// Feeds `frames` to a usage tap that holds at most `limit` bytes of an event not yet ended
    /// (the gateway's is `usage_event_limit()`) and takes the usage-only chunk out if `strip`,
    /// until the stream ends or the tap refuses an event.
    pub fn tap_usage<'a>(frames: impl IntoIterator<Item = &'a [u8]>, strip: bool, limit: usize) -> TappedStream {
        let mut tap = crate::tenants::usage::UsageTap::with_limit(strip, limit);
        let mut stream = TappedStream {
            out: Vec::new(),
            usage: None,
            refused: false,
            most_held: 0,
        };
        for frame in frames {
            match tap.feed(bytes::Bytes::copy_from_slice(frame)) {
                Ok(out) => stream.out.extend_from_slice(&out),
                Err(err) => {
                    stream.out.extend_from_slice(&err.passed);
                    stream.refused = true;
                    break;
                }
            }
            stream.most_held = stream.most_held.max(tap.held());
        }
        stream.out.extend_from_slice(&tap.finish());
        stream.usage = tap.usage().map(|usage| (usage.prompt_tokens, usage.completion_tokens));
        stream
    }

    /// The most bytes of an event not yet ended the gateway's usage tap holds.
    pub fn usage_event_limit() -> usize {
        crate::tenants::usage::MAX_EVENT_BYTES
    }
}

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::state::AppState;

/// Why the gateway could not start, or a policy could not be checked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// The policy engine could not start.
    #[error(transparent)]
    PolicyEngine(#[from] policy::PolicyError),
    /// TLS could not be set up.
    #[error(transparent)]
    Tls(#[from] server::tls::TlsError),
    /// The listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file the gateway reloads on change cannot be watched.
    #[error(transparent)]
    Watch(#[from] reload::WatchError),
    /// The embedded mockers could not start.
    #[error("cannot start the embedded mockers: {0}")]
    Mockers(std::io::Error),
    /// The router or batcher policy could not be loaded.
    #[error("policy `{name}`: {source}")]
    Policy {
        /// The configured policy.
        name: String,
        /// Why.
        source: policy::PolicyError,
    },
    /// A model's tokenizer could not be loaded.
    #[error(transparent)]
    Kv(#[from] kv::KvSetupError),
    /// Media fetching (`[media] fetch`) could not be set up.
    #[error("{0}")]
    Fetch(String),
    /// The NATS server could not be reached.
    #[error("cannot connect to NATS at `{url}`: {reason}")]
    Nats {
        /// The configured URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// No admin token is configured and none could be generated (no OS randomness).
    #[error("cannot generate an admin token (no OS randomness); set `admin.token`")]
    AdminToken,
    /// `admin.worker_token_file` could not be read at start.
    #[error("`{key}` {reason}")]
    WorkerToken {
        /// The configuration key.
        key: &'static str,
        /// Why.
        reason: String,
    },
    /// A configured policy name is neither a `.wasm` file nor a built-in.
    #[error(transparent)]
    UnknownBuiltIn(#[from] built_ins::UnknownBuiltIn),
    /// A worker URL did not parse.
    #[error("invalid worker URL: {0}")]
    WorkerUrl(#[from] http::uri::InvalidUri),
}

/// A running gateway; dropping it stops the listener, the health checker and embedded mockers.
#[derive(Debug)]
pub struct Gateway {
    addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    admin_token: Option<String>,
    admin_token_generated: bool,
    admin_tls: bool,
    tls: Option<server::tls::Tls>,
    state: Arc<AppState>,
    tasks: Vec<JoinHandle<()>>,
    #[cfg(feature = "embedded-mockers")]
    mockers: workers::embedded::EmbeddedFleet,
}

impl Gateway {
    /// Starts the gateway described by `config` on the current tokio runtime.
    ///
    /// # Errors
    ///
    /// Returns [`Error`] if the configuration is invalid, TLS cannot be set up, the listen
    /// address cannot be bound, or embedded mockers cannot start.
    #[cfg_attr(
        not(feature = "embedded-mockers"),
        allow(unused_mut, reason = "embedded mockers add their workers to the configuration")
    )]
    pub async fn start(mut config: Config) -> Result<Gateway, Error> {
        config.validate(std::path::Path::new("<config>"))?;
        let tls = start::client_tls(&config)?;
        #[cfg(feature = "embedded-mockers")]
        let mockers = start::embedded_mockers(&mut config).await?;
        let policies = start::Policies::load(&config)?;
        let mut metrics = Metrics::new();
        let (mut observers, admission_metrics) = start::Observers::register(&config, &policies, &mut metrics)?;
        let mut tasks = start::Tasks::new();
        let core = start::Core::build(
            &config,
            &policies,
            &observers.kv,
            admission_metrics,
            metrics,
            &mut tasks,
        )?;
        #[cfg(feature = "embedded-mockers")]
        tasks.extend(events::bus::connect(mockers.event_sources(), core.inbound.clone()));
        let (listener, addr) = start::bind(config.server.listen).await?;
        start::event_transports(&config, &observers.kv, &core.inbound, &mut tasks).await?;
        start::background_tasks(&config, &core, tls.as_ref(), &observers, &policies, &mut tasks)?;
        let fleet = start::join_fleet(&config, &policies, &mut tasks).await?;
        let planning = observers.planning.take();
        let planner = start::start_planner(&config, planning, &core, &observers.kv, fleet.as_ref(), &mut tasks);
        let admin_state = start::admin_state(&config, &core, &policies, fleet, planner);
        let admin = start::serve_admin(&config, admin_state, &observers.tls_reloads, &mut tasks).await?;
        let state = Arc::new(start::app_state(&config, &core, &policies, observers)?);
        tasks.push(tokio::spawn(server::conn::accept_loop(
            listener,
            tls.clone(),
            state.clone(),
        )));
        Ok(Gateway {
            addr,
            tls,
            state,
            admin_addr: admin.as_ref().map(|admin| admin.addr),
            admin_token_generated: admin.as_ref().is_some_and(|admin| admin.generated),
            admin_token: admin.map(|admin| admin.token),
            admin_tls: config.admin.as_ref().is_some_and(|admin| admin.tls.is_some()),
            tasks,
            #[cfg(feature = "embedded-mockers")]
            mockers,
        })
    }

    /// The address the client listener is bound to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drains the client listener, for a graceful exit: new requests are answered 503
    /// (`shutting_down`) and `/readyz` 503, idle connections are closed, and the responses in
    /// flight (streams included) run to their end, for up to `timeout`. Answers whether
    /// everything finished in time.
    pub async fn drain(&self, timeout: std::time::Duration) -> bool {
        self.state.draining.store(true, std::sync::atomic::Ordering::SeqCst);
        let graceful = self.state.graceful.lock().ok().and_then(|mut graceful| graceful.take());
        let Some(graceful) = graceful else {
            return true;
        };
        let open = graceful.count();
        tracing::info!(
            connections = open,
            ?timeout,
            "draining: waiting for the responses in flight"
        );
        tokio::time::timeout(timeout, graceful.shutdown()).await.is_ok()
    }

    /// The name and loopback address of each embedded mocker engine, in pool order (their own
    /// `/metrics` show engine internals such as preemptions and KV usage).
    pub fn embedded_mockers(&self) -> Vec<(String, SocketAddr)> {
        #[cfg(not(feature = "embedded-mockers"))]
        return Vec::new();
        #[cfg(feature = "embedded-mockers")]
        self.mockers.engine_addresses()
    }

    /// The name and loopback address of each embedded mocker encoder.
    pub fn embedded_encoders(&self) -> Vec<(String, SocketAddr)> {
        #[cfg(not(feature = "embedded-mockers"))]
        return Vec::new();
        #[cfg(feature = "embedded-mockers")]
        self.mockers.encoder_addresses()
    }

    /// The address of the admin listener, if the admin API is configured.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// The admin API's `https://ADDR` (when `[admin.tls]` is set) or `http://ADDR`, if the admin
    /// API is configured.
    pub fn admin_url(&self) -> Option<String> {
        let scheme = if self.admin_tls { "https" } else { "http" };
        self.admin_addr.map(|addr| format!("{scheme}://{addr}"))
    }

    /// `https://ADDR` or `http://ADDR`.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The SHA-256 fingerprint of the certificate served now, if TLS is on.
    pub fn fingerprint(&self) -> Option<String> {
        self.tls.as_ref().map(server::tls::Tls::fingerprint)
    }

    /// The admin API's bearer token (the configured one, or the one generated at start when
    /// `[admin]` names none), if the admin API is configured.
    pub fn admin_token(&self) -> Option<&str> {
        self.admin_token.as_deref()
    }

    /// The admin token when it was generated at start (dev mode without `admin.token`); `None`
    /// when it came from the configuration, which is never to be shown.
    pub fn generated_admin_token(&self) -> Option<&str> {
        self.admin_token.as_deref().filter(|_| self.admin_token_generated)
    }

    /// Whether client requests need an API key (`[[api_keys]]` or `[tenants] keys_file`).
    pub fn needs_api_key(&self) -> bool {
        self.state.tenants.required()
    }

    /// The models served by the workers now in the pool.
    pub fn models(&self) -> Vec<String> {
        self.state.router.pool().models()
    }

    /// How many workers are in the pool now.
    pub fn worker_count(&self) -> usize {
        self.state
            .router
            .pool()
            .workers()
            .iter()
            .filter(|w| w.role.is_llm())
            .count()
    }

    /// The number of encoder workers (vision and audio) in the pool now.
    pub fn encoder_count(&self) -> usize {
        self.state.router.pool().workers().len() - self.worker_count()
    }
}

/// The component of built-in router `name` (`round-robin`, `least-load`, `kv-aware`,
/// `predicted-ttft`, `modality-aware`, `cost-aware`, the disaggregating `pd-threshold` and
/// `pd-predicted`, and the peers' `peer-llm-d`, `peer-sglang`, `peer-aibrix`), as embedded in
/// this binary.
pub fn built_in_policy(name: &str) -> Option<&'static [u8]> {
    built_ins::router(name).ok()
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.state.tenants.save_usage();
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shared_handles_are_send_and_sync() {
        assert_send_sync::<crate::Gateway>();
        assert_send_sync::<crate::state::AppState>();
        assert_send_sync::<crate::routing::Router>();
        assert_send_sync::<crate::workers::WorkerPool>();
    }
}
