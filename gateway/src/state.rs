//! What the listeners share: the client listener's [`AppState`] and the admin API's
//! [`AdminState`]. Both are assembled by `Gateway::start` and private to the crate; handlers
//! reach workers only through the routing core ([`Router`]) and the worker client.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::config::{ForwardingConfig, ServerConfig};
use crate::encoders::Encoders;
use crate::events::applier::Inbound;
use crate::media::MediaSettings;
use crate::metrics::Metrics;
use crate::policy::batching::BatcherSwitch;
use crate::policy::runtime::PolicyRuntime;
use crate::routing::Router;
use crate::workers::client::WorkerClient;

/// State shared by every client connection and request.
#[derive(Debug)]
pub(crate) struct AppState {
    /// The client listener's limits.
    pub(crate) server: ServerConfig,
    /// Retries and timeouts towards workers.
    pub(crate) forwarding: ForwardingConfig,
    /// Where requests go.
    pub(crate) router: Arc<Router>,
    /// The client that reaches workers.
    pub(crate) client: WorkerClient,
    /// Exported metrics.
    pub(crate) metrics: Arc<Metrics>,
    /// Media limits and each model's media settings.
    pub(crate) media: MediaSettings,
    /// Fetches media URLs (`[media] fetch`), when on.
    pub(crate) fetcher: Option<crate::fetch::Fetcher>,
    /// The queue in front of full workers.
    pub(crate) admission: Arc<crate::admission::Admission>,
    /// Recent figures per worker and tenant, for the dashboard.
    pub(crate) live: Arc<crate::live::Live>,
    /// Latency-target attainment and cost served.
    pub(crate) slo: crate::slo::SloMetrics,
    /// API keys, tenants' limits and usage.
    pub(crate) tenants: Arc<crate::tenants::Tenants>,
    /// The queues in front of encoder workers.
    pub(crate) encoders: Arc<Encoders>,
    /// Set on SIGTERM or ctrl-c: new requests are refused, `/readyz` answers 503.
    pub(crate) draining: std::sync::atomic::AtomicBool,
    /// One permit per open client connection (`server.max_connections`).
    pub(crate) connections: Arc<tokio::sync::Semaphore>,
    /// Watches every served connection, so a drain can wait for their responses; taken when
    /// the drain starts.
    pub(crate) graceful: std::sync::Mutex<Option<hyper_util::server::graceful::GracefulShutdown>>,
}

/// State of the admin API: policies, worker registrations, KV inspection.
#[derive(Debug)]
pub(crate) struct AdminState {
    /// The routing core (pool, KV state, live policy).
    pub(crate) router: Arc<Router>,
    /// Compiles and validates new policy versions.
    pub(crate) runtime: Arc<PolicyRuntime>,
    /// The configured policy settings, for versions uploaded without their own.
    pub(crate) policy_config: toml::Table,
    /// The live batcher of the encoder queues.
    pub(crate) batchers: Arc<BatcherSwitch>,
    /// The configured batcher settings, for batchers uploaded without their own.
    pub(crate) batcher_config: toml::Table,
    /// The fleet this gateway shares its router policy with (`[fleet]`).
    pub(crate) fleet: Option<Arc<crate::fleet::Fleet>>,
    /// The planner, when `[planner]` is configured.
    pub(crate) planner: Option<Arc<crate::planner::Planner>>,
    /// The admission queue (its depth per tenant, for the dashboard).
    pub(crate) admission: Arc<crate::admission::Admission>,
    /// Recent figures per worker and tenant, for the dashboard.
    pub(crate) live: Arc<crate::live::Live>,
    /// The live batcher of the admission queue.
    pub(crate) admission_batchers: Arc<BatcherSwitch>,
    /// The configured admission batcher settings, for those uploaded without their own.
    pub(crate) admission_batcher_config: toml::Table,
    /// Where registrations and KV events posted by workers go (the applier).
    pub(crate) events: mpsc::UnboundedSender<Inbound>,
    /// The client that fetches dumps from workers.
    pub(crate) client: WorkerClient,
    /// Exported metrics (`GET /metrics` on the admin listener).
    pub(crate) metrics: Arc<Metrics>,
}
