//! Switchyard: a TLS gateway that speaks the OpenAI API and routes each request to a worker.
//!
//! The public API is small: [`Gateway::start`] takes a [`Config`] (loaded and validated from
//! TOML), starts any embedded mockers, the event applier, the health checker and the
//! listeners, and returns a handle that keeps them running; [`check_policy`] validates a
//! policy component offline; [`Error`] says why either failed.
//!
//! Inside, the modules follow the request: `server` (connections, TLS, handlers, relay) →
//! `routing` (the routing core: pool, KV state and policy answer where a request goes, and a
//! lease holds the worker until the answer ends) → `workers` (registry, health, client).
//! `kv` holds the prefix index, the active sequences and prompt hashing; `events` keeps them
//! and the pool in step with what workers announce; `policy` is the only module that knows
//! wasmtime; `admin` serves the admin API; `config` and `metrics` sit on the side. [`bench`]
//! exposes what the benchmarks and soak tests drive directly; it is not a stable API.

#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]

mod admin;
mod admission;
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
    pub use crate::events::applier::MAX_BATCH;
    pub use crate::kv::index::{IndexSize, KvIndex, Overlap, Overlaps};
    pub use crate::policy::host::{PrefillFit, WorkerTiming};
    pub use crate::policy::runtime::{PolicyRuntime, RuntimeConfig, TimingSource};
    pub use crate::policy::switch::{PolicySwitch, SwitchConfig};
    pub use crate::policy::{built_in_router, table};
}

/// What the planner tests drive directly: a planner policy behind the real host (sandbox,
/// answer checks, fallback, rollback) with scripted observations. Not a stable API.
#[doc(hidden)]
pub mod planning {
    pub use crate::policy::PolicyError;
    pub use crate::policy::built_in_planner;
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
    pub use crate::events::http::{events as posted_events, registration as posted_registration};
    pub use crate::events::vllm::Translator;
    pub use crate::events::vllm::decode::{BytesHashFold, decode_batch_with};
    pub use crate::kv::index::KvIndex;
    pub use crate::policy::batching::{
        Batch, Budget, PendingTable, fallback as fallback_batches, validate as check_batches,
    };
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
}

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::config::Mode;
use crate::metrics::Metrics;
use crate::state::AppState;
use crate::workers::WorkerPool;
use crate::workers::client::WorkerClient;

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
        let tls = match (&config.server.tls, config.server.plaintext) {
            (_, true) => None,
            (Some(files), false) => Some(server::tls::from_files(files)?),
            (None, false) => {
                // Validation allows this only in dev mode.
                debug_assert_eq!(config.mode, Mode::Dev);
                Some(server::tls::self_signed()?)
            }
        };
        if let Some(tls) = &tls {
            tracing::info!(fingerprint = %tls.fingerprint(), self_signed = tls.self_signed, "TLS certificate (SHA-256)");
        }
        #[cfg(feature = "embedded-mockers")]
        let mut mockers = workers::embedded::EmbeddedFleet::default();
        #[cfg(feature = "embedded-mockers")]
        if let Some(embedded) = config.embedded_mockers.as_ref().filter(|m| m.count > 0) {
            let (fleet, entries) = workers::embedded::start(embedded).await.map_err(Error::Mockers)?;
            mockers = fleet;
            config.workers.extend(entries);
        }
        let policy_runtime = Arc::new(policy::runtime::PolicyRuntime::new(policy::runtime::RuntimeConfig {
            deadline: std::time::Duration::from_millis(config.policy.deadline_ms),
            memory_limit_bytes: config.policy.memory_limit_mib << 20,
            cache_dir: config.policy.cache_dir.clone(),
            max_instances: config
                .policy
                .max_instances
                .unwrap_or_else(policy::runtime::default_max_instances),
        })?);
        let router_policy = load_router(&policy_runtime, &config.policy.router, config.policy.config.clone())?;
        let switch = Arc::new(policy::switch::PolicySwitch::new(
            router_policy,
            policy::switch::SwitchConfig {
                max_failures: config.policy.max_failures,
                ..Default::default()
            },
        ));
        let batcher = load_policy(&config.encoders.batcher, policy::built_in_batcher, |name, bytes| {
            policy_runtime.load_batcher(name, bytes, config.encoders.batcher_config.clone())
        })?;
        let batchers = Arc::new(policy::batching::BatcherSwitch::new(
            batcher,
            policy::switch::SwitchConfig {
                max_failures: config.policy.max_failures,
                ..Default::default()
            },
        ));
        let admission_settings = config.admission.clone();
        let (admission_batcher, admission_batcher_config) = match &admission_settings {
            Some(admission) => (admission.batcher.as_str(), admission.batcher_config.clone()),
            None => ("fcfs", toml::Table::new()),
        };
        let admission_batcher = load_policy(admission_batcher, policy::built_in_batcher, |name, bytes| {
            policy_runtime.load_batcher(name, bytes, admission_batcher_config.clone())
        })?;
        let admission_batchers = Arc::new(policy::batching::BatcherSwitch::new(
            admission_batcher,
            policy::switch::SwitchConfig {
                max_failures: config.policy.max_failures,
                ..Default::default()
            },
        ));
        let kv = Arc::new(kv::KvState::new(&config)?);
        let mut metrics = Metrics::new();
        switch.register_metrics(metrics.registry_mut());
        batchers.register_metrics(metrics.registry_mut());
        kv.metrics.register(metrics.registry_mut());
        let encoder_metrics = Arc::new(encoders::EncoderMetrics::new());
        encoder_metrics.register(metrics.registry_mut());
        let watch_outcomes = policy::watch::WatchOutcomes::default();
        metrics.registry_mut().register(
            "policy_watch",
            "Policy files loaded from policy.watch_dir, by outcome",
            watch_outcomes.clone(),
        );
        let tls_reloads = server::tls::ReloadOutcomes::default();
        metrics.registry_mut().register(
            "tls_reloads",
            "TLS certificate reloads after a change to its files or SIGHUP, by outcome",
            tls_reloads.clone(),
        );
        let tenants = Arc::new(tenants::Tenants::new(&config)?);
        tenants.register_metrics(metrics.registry_mut());
        let mut slo = slo::SloMetrics::default();
        slo.register(metrics.registry_mut());
        let planning = match &config.planner {
            Some(settings) => {
                let policy = load_policy(&settings.policy, policy::built_in_planner, |name, bytes| {
                    policy_runtime.load_planner(name, bytes, settings.policy_config.clone())
                })?;
                let switch = Arc::new(policy::planning::PlannerSwitch::new(
                    policy,
                    policy::switch::SwitchConfig {
                        max_failures: config.policy.max_failures,
                        ..Default::default()
                    },
                ));
                let planner_metrics = planner::PlannerMetrics::default();
                planner_metrics.register(metrics.registry_mut(), &switch);
                let window = Arc::new(planner::window::Window::default());
                slo.observe_into(window.clone());
                Some((settings.clone(), switch, window, planner_metrics))
            }
            None => None,
        };
        let admission_metrics = admission::AdmissionMetrics::default();
        admission_metrics.register(metrics.registry_mut(), &admission_batchers);
        let metrics = Arc::new(metrics);
        let pool = Arc::new(WorkerPool::new(&config.workers, metrics.clone())?);
        policy_runtime.provide_timings(pool.clone());
        let admission = Arc::new(admission::Admission::new(
            admission_settings,
            pool.clone(),
            kv.clone(),
            admission_batchers,
            admission_metrics,
        ));
        for worker in pool.workers().iter().filter(|w| w.role == config::Role::Llm) {
            kv.check_block_size(&worker.name, &worker.model, worker.block_size);
        }
        let (inbound, applier) = events::applier::spawn(
            kv.clone(),
            pool.clone(),
            events::applier::SyncConfig {
                heartbeat_misses: config.kv.heartbeat_misses,
                resync_buffer: config.kv.resync_buffer,
                resync_timeout: std::time::Duration::from_millis(config.kv.resync_timeout_ms),
            },
        );
        let router = Arc::new(routing::Router::new(pool.clone(), kv.clone(), switch, inbound.clone()));
        #[allow(unused_mut, reason = "only embedded mockers add tasks here")]
        let mut tasks = vec![applier];
        #[cfg(feature = "embedded-mockers")]
        tasks.extend(events::bus::connect(mockers.event_sources(), inbound.clone()));
        let client = WorkerClient::new(&config.forwarding);
        let listener = TcpListener::bind(config.server.listen)
            .await
            .map_err(|source| Error::Bind {
                addr: config.server.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| Error::Bind {
            addr: config.server.listen,
            source,
        })?;
        if let Some(url) = &config.kv.nats_url {
            let client = events::nats::connect(url).await.map_err(|reason| Error::Nats {
                url: url.clone(),
                reason,
            })?;
            let subjects = switchyard_protocol::kv_events::Subjects::new(config.kv.subject_prefix.clone());
            tasks.extend(
                events::nats::start(client, subjects, config.kv.replica_sync, kv.clone(), inbound.clone())
                    .await
                    .map_err(|reason| Error::Nats {
                        url: url.clone(),
                        reason,
                    })?,
            );
        }
        for vllm in &config.kv.vllm {
            let block_size = config
                .workers
                .iter()
                .find(|w| w.display_name() == vllm.worker)
                .map_or(64, |w| w.block_size);
            tasks.push(events::vllm::spawn(
                vllm.clone(),
                block_size,
                kv.clone(),
                inbound.clone(),
            ));
        }
        let health = {
            let router = router.clone();
            workers::health::spawn(pool.clone(), client.clone(), config.health.clone(), move |worker| {
                router.worker_lost(worker)
            })
        };
        tasks.push(health);
        if let (Some(tls), Some(files)) = (&tls, &config.server.tls) {
            tasks.push(server::tls::spawn_reloader(
                "client",
                tls.clone(),
                files.clone(),
                tls_reloads.clone(),
            )?);
        }
        tasks.extend(tenants.spawn_tasks()?);
        tasks.extend(admission.spawn());
        if let Some(dir) = &config.policy.watch_dir {
            tasks.push(policy::watch::spawn(
                dir,
                policy_runtime.clone(),
                router.policy().clone(),
                config.policy.config.clone(),
                watch_outcomes,
            )?);
        }
        let fleet = match &config.fleet {
            Some(settings) => {
                let fleet = Arc::new(
                    fleet::Fleet::connect(settings, policy_runtime.clone(), router.policy().clone())
                        .await
                        .map_err(|reason| Error::Nats {
                            url: settings.nats_url.clone(),
                            reason,
                        })?,
                );
                tasks.push(fleet.spawn());
                Some(fleet)
            }
            None => None,
        };
        let planner = planning.map(|(settings, switch, window, planner_metrics)| {
            let lease: Box<dyn planner::Lease> = match &fleet {
                Some(fleet) => Box::new(fleet::PlanningLease::new(
                    fleet.clone(),
                    std::time::Duration::from_millis(settings.lease_ms),
                )),
                None => Box::new(planner::Alone),
            };
            let targets = config
                .models
                .iter()
                .map(|model| {
                    (
                        model.name.clone(),
                        (model.ttft_target_ms.unwrap_or(0.0), model.itl_target_ms.unwrap_or(0.0)),
                    )
                })
                .collect();
            let planner = Arc::new(planner::Planner::new(
                settings,
                switch,
                window,
                planner_metrics,
                pool.clone(),
                kv.clone(),
                lease,
                targets,
            ));
            tasks.push(planner.spawn());
            planner
        });
        let live = Arc::new(live::Live::default());
        let mut admin_addr = None;
        let mut admin_token = None;
        if let Some(admin) = config.admin.clone() {
            let listener = TcpListener::bind(admin.listen).await.map_err(|source| Error::Bind {
                addr: admin.listen,
                source,
            })?;
            admin_addr = Some(listener.local_addr().map_err(|source| Error::Bind {
                addr: admin.listen,
                source,
            })?);
            let token = match admin.token {
                Some(token) => token,
                None => admin::generate_token().ok_or(Error::AdminToken)?,
            };
            let admin_state = Arc::new(state::AdminState {
                router: router.clone(),
                runtime: policy_runtime.clone(),
                policy_config: config.policy.config.clone(),
                batchers: batchers.clone(),
                batcher_config: config.encoders.batcher_config.clone(),
                admission_batchers: admission.batchers().clone(),
                fleet: fleet.clone(),
                planner: planner.clone(),
                admission: admission.clone(),
                live: live.clone(),
                admission_batcher_config: config
                    .admission
                    .as_ref()
                    .map(|admission| admission.batcher_config.clone())
                    .unwrap_or_default(),
                events: inbound.clone(),
                client: client.clone(),
                metrics: metrics.clone(),
            });
            let admin_tls = match &admin.tls {
                Some(files) => {
                    let tls = server::tls::admin_from_files(files)?;
                    tasks.push(server::tls::spawn_reloader(
                        "admin",
                        tls.clone(),
                        files.pair(),
                        tls_reloads.clone(),
                    )?);
                    Some(tls.acceptor)
                }
                None => None,
            };
            tasks.push(tokio::spawn(admin::serve(
                listener,
                token.clone(),
                admin_state,
                admin_tls,
            )));
            admin_token = Some(token);
        }
        let admin_tls = config.admin.as_ref().is_some_and(|admin| admin.tls.is_some());
        let fetcher = fetch::Fetcher::new(&config.media).map_err(|err| Error::Fetch(err.to_string()))?;
        let state = Arc::new(AppState {
            server: config.server.clone(),
            forwarding: config.forwarding.clone(),
            router,
            client: client.clone(),
            metrics,
            media: media::MediaSettings::from_config(&config),
            fetcher,
            tenants,
            admission: admission.clone(),
            live: live.clone(),
            slo,
            encoders: Arc::new(encoders::Encoders::new(
                config.encoders.clone(),
                client,
                pool.clone(),
                kv.clone(),
                batchers,
                encoder_metrics,
            )),
            draining: std::sync::atomic::AtomicBool::new(false),
            connections: Arc::new(tokio::sync::Semaphore::new(config.server.max_connections)),
            graceful: std::sync::Mutex::new(Some(hyper_util::server::graceful::GracefulShutdown::new())),
        });
        let accept = tokio::spawn(server::conn::accept_loop(listener, tls.clone(), state.clone()));
        Ok(Gateway {
            addr,
            tls,
            state,
            admin_addr,
            admin_token,
            admin_tls,
            tasks: {
                tasks.push(accept);
                tasks
            },
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
            .filter(|w| w.role == config::Role::Llm)
            .count()
    }

    /// The number of encoder workers (vision and audio) in the pool now.
    pub fn encoder_count(&self) -> usize {
        self.state.router.pool().workers().len() - self.worker_count()
    }
}

/// The component of built-in router `name` (`round-robin`, `least-load`, `kv-aware`,
/// `predicted-ttft`, `modality-aware`, `cost-aware`, and the peers' `peer-llm-d`,
/// `peer-sglang`, `peer-aibrix`), as embedded in this binary.
pub fn built_in_policy(name: &str) -> Option<&'static [u8]> {
    policy::built_in_router(name).ok()
}

/// Loads the router named in the configuration: a built-in name or a `.wasm` path.
fn load_router(
    runtime: &Arc<policy::runtime::PolicyRuntime>,
    name: &str,
    config: toml::Table,
) -> Result<policy::runtime::RouterPolicy, Error> {
    load_policy(name, policy::built_in_router, |name, bytes| {
        runtime.load_router(name, bytes, config)
    })
}

/// Loads the policy `name`: a `.wasm` file by path, else the built-in `built_in` knows.
fn load_policy<P>(
    name: &str,
    built_in: fn(&str) -> Result<&'static [u8], policy::PolicyError>,
    load: impl FnOnce(&str, &[u8]) -> Result<P, policy::PolicyError>,
) -> Result<P, Error> {
    let fail = |source| Error::Policy {
        name: name.to_string(),
        source,
    };
    let bytes = if name.ends_with(".wasm") {
        std::fs::read(name).map_err(|err| fail(policy::PolicyError::Invalid(format!("cannot read `{name}`: {err}"))))?
    } else {
        built_in(name).map_err(fail)?.to_vec()
    };
    load(name, &bytes).map_err(fail)
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
