//! Wiring a gateway from its validated configuration, one subsystem at a time.
//!
//! [`Gateway::start`](crate::Gateway::start) calls these builders in dependency order: the
//! client TLS and any embedded mockers, then the policies (router, batchers and their
//! sandbox), the metrics every part registers into, the routing core (pool, KV state,
//! admission queue, event applier), the event transports and background tasks, the fleet and
//! the planner, the admin listener, and last the client listener's state. Each builder owns
//! one subsystem's setup and hands back what later ones need; the tasks it spawns go into the
//! gateway's task list, which stops them when the gateway is dropped.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::built_ins::{self, World};
use crate::config::{Config, Mode};
use crate::events::applier::Inbound;
use crate::metrics::Metrics;
use crate::policy::batching::BatcherSwitch;
use crate::policy::planning::PlannerSwitch;
use crate::policy::runtime::{PolicyRuntime, RuntimeConfig, default_max_instances};
use crate::policy::switch::{PolicySwitch, SwitchConfig};
use crate::state::{AdminState, AppState};
use crate::workers::WorkerPool;
use crate::workers::client::WorkerClient;
use crate::{
    Error, admin, admission, encoders, events, fetch, fleet, kv, live, media, planner, policy, routing, server, slo,
    tenants, workers,
};

/// The tasks a gateway runs; aborted when it is dropped.
pub(crate) type Tasks = Vec<JoinHandle<()>>;

/// The client listener's TLS: the configured certificate, none with `plaintext`, or a
/// self-signed one (dev mode only, as validation ensures).
pub(crate) fn client_tls(config: &Config) -> Result<Option<server::tls::Tls>, Error> {
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
    Ok(tls)
}

/// Starts the `[embedded_mockers]` and adds them to the configured workers.
#[cfg(feature = "embedded-mockers")]
pub(crate) async fn embedded_mockers(config: &mut Config) -> Result<workers::embedded::EmbeddedFleet, Error> {
    let Some(embedded) = config.embedded_mockers.as_ref().filter(|m| m.count > 0) else {
        return Ok(workers::embedded::EmbeddedFleet::default());
    };
    let (fleet, entries) = workers::embedded::start(embedded).await.map_err(Error::Mockers)?;
    config.workers.extend(entries);
    Ok(fleet)
}

/// The policies a gateway runs and the sandbox they run in.
pub(crate) struct Policies {
    pub(crate) runtime: Arc<PolicyRuntime>,
    /// The live router.
    pub(crate) router: Arc<PolicySwitch>,
    /// The encoder queues' batcher.
    pub(crate) batchers: Arc<BatcherSwitch>,
    /// The admission queue's batcher.
    pub(crate) admission_batchers: Arc<BatcherSwitch>,
}

impl Policies {
    /// Starts the sandbox and loads the configured router and batchers into it.
    pub(crate) fn load(config: &Config) -> Result<Policies, Error> {
        let runtime = Arc::new(PolicyRuntime::new(RuntimeConfig {
            deadline: std::time::Duration::from_millis(config.policy.deadline_ms),
            memory_limit_bytes: config.policy.memory_limit_mib << 20,
            cache_dir: config.policy.cache_dir.clone(),
            max_instances: config.policy.max_instances.unwrap_or_else(default_max_instances),
        })?);
        let switch_config = || SwitchConfig {
            max_failures: config.policy.max_failures,
            ..Default::default()
        };
        let router = load_policy(&config.policy.router, World::Router, |name, bytes| {
            runtime.load_router(name, bytes, config.policy.config.clone())
        })?;
        let router = Arc::new(PolicySwitch::new(router, switch_config()));
        let batcher = load_policy(&config.encoders.batcher, World::Batcher, |name, bytes| {
            runtime.load_batcher(name, bytes, config.encoders.batcher_config.clone())
        })?;
        let batchers = Arc::new(BatcherSwitch::new(batcher, switch_config()));
        let (admission_batcher, admission_batcher_config) = match &config.admission {
            Some(admission) => (admission.batcher.as_str(), admission.batcher_config.clone()),
            None => ("fcfs", toml::Table::new()),
        };
        let admission_batcher = load_policy(admission_batcher, World::Batcher, |name, bytes| {
            runtime.load_batcher(name, bytes, admission_batcher_config)
        })?;
        let admission_batchers = Arc::new(BatcherSwitch::new(admission_batcher, switch_config()));
        Ok(Policies {
            runtime,
            router,
            batchers,
            admission_batchers,
        })
    }
}

/// Loads the policy `name`: a `.wasm` file by path, else the built-in of `world` so named.
fn load_policy<P>(
    name: &str,
    world: World,
    load: impl FnOnce(&str, &[u8]) -> Result<P, policy::PolicyError>,
) -> Result<P, Error> {
    let fail = |source| Error::Policy {
        name: name.to_string(),
        source,
    };
    let bytes = if name.ends_with(".wasm") {
        std::fs::read(name).map_err(|err| fail(policy::PolicyError::Invalid(format!("cannot read `{name}`: {err}"))))?
    } else {
        built_ins::find(world, name)?.to_vec()
    };
    load(name, &bytes).map_err(fail)
}

/// What reports into the gateway's metrics besides the policies: each made and registered
/// here, in the order `/metrics` lists them.
pub(crate) struct Observers {
    pub(crate) kv: Arc<kv::KvState>,
    pub(crate) encoder_metrics: Arc<encoders::EncoderMetrics>,
    pub(crate) watch_outcomes: policy::watch::WatchOutcomes,
    pub(crate) tls_reloads: server::tls::ReloadOutcomes,
    pub(crate) tenants: Arc<tenants::Tenants>,
    pub(crate) slo: slo::SloMetrics,
    pub(crate) planning: Option<Planning>,
}

/// A `[planner]`'s policy and what it observes, before the planner starts.
pub(crate) struct Planning {
    switch: Arc<PlannerSwitch>,
    window: Arc<planner::window::Window>,
    metrics: planner::PlannerMetrics,
}

impl Observers {
    /// Makes the KV state, the tenants, the latency targets' figures and the planner's policy,
    /// and registers them, the policies' counters and the admission queue's (answered apart:
    /// the queue is built with the routing core) into `metrics`.
    pub(crate) fn register(
        config: &Config,
        policies: &Policies,
        metrics: &mut Metrics,
    ) -> Result<(Observers, admission::AdmissionMetrics), Error> {
        let registry = metrics.registry_mut();
        let kv = Arc::new(kv::KvState::new(config)?);
        policies.router.register_metrics(registry);
        policies.batchers.register_metrics(registry);
        kv.metrics.register(registry);
        let encoder_metrics = Arc::new(encoders::EncoderMetrics::new());
        encoder_metrics.register(registry);
        let watch_outcomes = policy::watch::WatchOutcomes::default();
        registry.register(
            "policy_watch",
            "Policy files loaded from policy.watch_dir, by outcome",
            watch_outcomes.clone(),
        );
        let tls_reloads = server::tls::ReloadOutcomes::default();
        registry.register(
            "tls_reloads",
            "TLS certificate reloads after a change to its files or SIGHUP, by outcome",
            tls_reloads.clone(),
        );
        let tenants = Arc::new(tenants::Tenants::new(config)?);
        tenants.register_metrics(metrics);
        let registry = metrics.registry_mut();
        let mut slo = slo::SloMetrics::default();
        slo.register(registry);
        let planning = match &config.planner {
            Some(settings) => {
                let policy = load_policy(&settings.policy, World::Planner, |name, bytes| {
                    policies
                        .runtime
                        .load_planner(name, bytes, settings.policy_config.clone())
                })?;
                let switch = Arc::new(PlannerSwitch::new(
                    policy,
                    SwitchConfig {
                        max_failures: config.policy.max_failures,
                        ..Default::default()
                    },
                ));
                let planner_metrics = planner::PlannerMetrics::default();
                planner_metrics.register(registry, &switch);
                let window = Arc::new(planner::window::Window::default());
                slo.observe_into(window.clone());
                Some(Planning {
                    switch,
                    window,
                    metrics: planner_metrics,
                })
            }
            None => None,
        };
        let admission_metrics = admission::AdmissionMetrics::default();
        admission_metrics.register(metrics, &policies.admission_batchers);
        let observers = Observers {
            kv,
            encoder_metrics,
            watch_outcomes,
            tls_reloads,
            tenants,
            slo,
            planning,
        };
        Ok((observers, admission_metrics))
    }
}

/// The routing core and what the listeners share with it: the pool, the admission queue in
/// front of it, the router, the channel into the event applier, the worker client, the
/// metrics and the dashboard's figures.
pub(crate) struct Core {
    pub(crate) pool: Arc<WorkerPool>,
    pub(crate) admission: Arc<admission::Admission>,
    pub(crate) router: Arc<routing::Router>,
    pub(crate) inbound: mpsc::UnboundedSender<Inbound>,
    pub(crate) client: WorkerClient,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) live: Arc<live::Live>,
}

impl Core {
    /// Builds the pool from the configured workers, the admission queue (counted in
    /// `admission_metrics`) and the router over `metrics`, now complete, and starts the event
    /// applier (its task goes into `tasks`).
    pub(crate) fn build(
        config: &Config,
        policies: &Policies,
        kv: &Arc<kv::KvState>,
        admission_metrics: admission::AdmissionMetrics,
        metrics: Metrics,
        tasks: &mut Tasks,
    ) -> Result<Core, Error> {
        let metrics = Arc::new(metrics);
        let pool = Arc::new(WorkerPool::new(&config.workers, metrics.clone())?);
        policies.runtime.provide_timings(pool.clone());
        let admission = Arc::new(admission::Admission::new(
            config.admission.clone(),
            pool.clone(),
            kv.clone(),
            policies.admission_batchers.clone(),
            admission_metrics,
        ));
        for worker in pool.workers().iter().filter(|w| w.role.is_llm()) {
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
        tasks.push(applier);
        let router = Arc::new(routing::Router::new(
            pool.clone(),
            kv.clone(),
            policies.router.clone(),
            inbound.clone(),
        ));
        Ok(Core {
            pool,
            admission,
            router,
            inbound,
            client: WorkerClient::new(&config.forwarding),
            metrics,
            live: Arc::new(live::Live::default()),
        })
    }
}

/// Binds a listener on `addr`, answering the address it got (the port, when `addr`'s is 0).
pub(crate) async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), Error> {
    let bind_error = |source| Error::Bind { addr, source };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    Ok((listener, bound))
}

/// Subscribes the applier to the KV event transports: NATS (`[kv] nats_url`) and each vLLM or
/// SGLang publisher (`[[kv.vllm]]`, `[[kv.sglang]]`).
pub(crate) async fn event_transports(
    config: &Config,
    kv: &Arc<kv::KvState>,
    inbound: &mpsc::UnboundedSender<Inbound>,
    tasks: &mut Tasks,
) -> Result<(), Error> {
    if let Some(url) = &config.kv.nats_url {
        let nats_error = |reason| Error::Nats {
            url: url.clone(),
            reason,
        };
        let client = events::nats::connect(url).await.map_err(nats_error)?;
        let subjects = switchyard_protocol::kv_events::Subjects::new(config.kv.subject_prefix.clone());
        tasks.extend(
            events::nats::start(client, subjects, config.kv.replica_sync, kv.clone(), inbound.clone())
                .await
                .map_err(nats_error)?,
        );
    }
    let adapters = (config.kv.vllm.iter().map(|a| ("vLLM", a))).chain(config.kv.sglang.iter().map(|a| ("SGLang", a)));
    for (engine, adapter) in adapters {
        let block_size = config
            .workers
            .iter()
            .find(|w| w.display_name() == adapter.worker)
            .map_or(64, |w| w.block_size);
        tasks.push(events::vllm::spawn(
            engine,
            adapter.clone(),
            block_size,
            kv.clone(),
            inbound.clone(),
        ));
    }
    Ok(())
}

/// Starts what runs beside the requests: health checks, the client certificate's reloader,
/// the tenants' and the admission queue's tasks, and the policy directory's watcher.
pub(crate) fn background_tasks(
    config: &Config,
    core: &Core,
    tls: Option<&server::tls::Tls>,
    observers: &Observers,
    policies: &Policies,
    tasks: &mut Tasks,
) -> Result<(), Error> {
    let router = core.router.clone();
    tasks.push(workers::health::spawn(
        core.pool.clone(),
        core.client.clone(),
        config.health.clone(),
        move |worker| router.worker_lost(worker),
    ));
    if let (Some(tls), Some(files)) = (tls, &config.server.tls) {
        tasks.push(server::tls::spawn_reloader(
            "client",
            tls.clone(),
            files.clone(),
            observers.tls_reloads.clone(),
        )?);
    }
    tasks.extend(observers.tenants.spawn_tasks()?);
    tasks.extend(core.admission.spawn());
    if let Some(dir) = &config.policy.watch_dir {
        tasks.push(policy::watch::spawn(
            dir,
            policies.runtime.clone(),
            core.router.policy().clone(),
            config.policy.config.clone(),
            observers.watch_outcomes.clone(),
        )?);
    }
    Ok(())
}

/// Joins the `[fleet]` of gateway replicas, if configured (its task goes into `tasks`).
pub(crate) async fn join_fleet(
    config: &Config,
    policies: &Policies,
    tasks: &mut Tasks,
) -> Result<Option<Arc<fleet::Fleet>>, Error> {
    let Some(settings) = &config.fleet else {
        return Ok(None);
    };
    let fleet = fleet::Fleet::connect(settings, policies.runtime.clone(), policies.router.clone())
        .await
        .map_err(|reason| Error::Nats {
            url: settings.nats_url.clone(),
            reason,
        })?;
    let fleet = Arc::new(fleet);
    tasks.push(fleet.spawn());
    Ok(Some(fleet))
}

/// Starts the `[planner]`, if configured: planning alone, or under the fleet's lease so one
/// replica plans at a time (its task goes into `tasks`).
pub(crate) fn start_planner(
    config: &Config,
    planning: Option<Planning>,
    core: &Core,
    kv: &Arc<kv::KvState>,
    fleet: Option<&Arc<fleet::Fleet>>,
    tasks: &mut Tasks,
) -> Option<Arc<planner::Planner>> {
    let (settings, planning) = config.planner.as_ref().zip(planning)?;
    let lease: Box<dyn planner::Lease> = match fleet {
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
        settings.clone(),
        planning.switch,
        planning.window,
        planning.metrics,
        core.pool.clone(),
        kv.clone(),
        lease,
        targets,
    ));
    tasks.push(planner.spawn());
    Some(planner)
}

/// The admin listener, when `[admin]` is configured: its address and bearer token.
pub(crate) struct AdminListener {
    pub(crate) addr: SocketAddr,
    pub(crate) token: String,
    /// Whether `token` was generated at start (dev mode without `admin.token`): only such a
    /// token is ever shown, since a configured one is a production secret.
    pub(crate) generated: bool,
}

/// Binds and serves the admin API (with its certificate's reloader, under `[admin.tls]`).
pub(crate) async fn serve_admin(
    config: &Config,
    state: AdminState,
    tls_reloads: &server::tls::ReloadOutcomes,
    tasks: &mut Tasks,
) -> Result<Option<AdminListener>, Error> {
    let Some(admin) = &config.admin else {
        return Ok(None);
    };
    let (listener, addr) = bind(admin.listen).await?;
    let (token, generated) = match &admin.token {
        Some(token) => (token.clone(), false),
        None => (admin::generate_token().ok_or(Error::AdminToken)?, true),
    };
    let worker_token = admin
        .worker_token()
        .map_err(|(key, reason)| Error::WorkerToken { key, reason })?;
    let acceptor = match &admin.tls {
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
        admin::Credentials {
            admin: token.clone(),
            worker: worker_token,
        },
        switchyard_protocol::serve::Limits {
            header_read_timeout: Some(admin.header_read_timeout()),
            max_connections: Some(admin.max_connections),
        },
        Arc::new(state),
        acceptor,
    )));
    Ok(Some(AdminListener { addr, token, generated }))
}

/// The admin API's state: the routing core, the policies and settings it manages, and what
/// its dashboard and fleet routes read.
pub(crate) fn admin_state(
    config: &Config,
    core: &Core,
    policies: &Policies,
    fleet: Option<Arc<fleet::Fleet>>,
    planner: Option<Arc<planner::Planner>>,
) -> AdminState {
    AdminState {
        router: core.router.clone(),
        runtime: policies.runtime.clone(),
        policy_config: config.policy.config.clone(),
        batchers: policies.batchers.clone(),
        batcher_config: config.encoders.batcher_config.clone(),
        admission_batchers: core.admission.batchers().clone(),
        fleet,
        planner,
        admission: core.admission.clone(),
        live: core.live.clone(),
        admission_batcher_config: config
            .admission
            .as_ref()
            .map(|admission| admission.batcher_config.clone())
            .unwrap_or_default(),
        events: core.inbound.clone(),
        client: core.client.clone(),
        metrics: core.metrics.clone(),
    }
}

/// The client listener's state: limits, the routing core, the worker client, media, tenants,
/// admission and the encoder queues.
pub(crate) fn app_state(
    config: &Config,
    core: &Core,
    policies: &Policies,
    observers: Observers,
) -> Result<AppState, Error> {
    let fetcher = fetch::Fetcher::new(&config.media).map_err(|err| Error::Fetch(err.to_string()))?;
    Ok(AppState {
        server: config.server.clone(),
        forwarding: config.forwarding.clone(),
        router: core.router.clone(),
        client: core.client.clone(),
        metrics: core.metrics.clone(),
        media: media::MediaSettings::from_config(config),
        fetcher,
        tenants: observers.tenants,
        admission: core.admission.clone(),
        live: core.live.clone(),
        slo: observers.slo,
        encoders: Arc::new(encoders::Encoders::new(
            config.encoders.clone(),
            core.client.clone(),
            core.pool.clone(),
            observers.kv,
            policies.batchers.clone(),
            observers.encoder_metrics,
        )),
        draining: std::sync::atomic::AtomicBool::new(false),
        connections: Arc::new(tokio::sync::Semaphore::new(config.server.max_connections)),
        graceful: std::sync::Mutex::new(Some(hyper_util::server::graceful::GracefulShutdown::new())),
    })
}
