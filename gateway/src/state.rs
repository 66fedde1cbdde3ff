//! What every request handler shares: configuration, workers, the worker client, metrics.

use std::sync::Arc;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::policy::switch::PolicySwitch;
use crate::workers::WorkerPool;
use crate::workers::client::WorkerClient;

/// State shared by every connection and request.
#[derive(Debug)]
pub struct AppState {
    /// The validated configuration.
    pub config: Config,
    /// The workers.
    pub pool: Arc<WorkerPool>,
    /// The client that reaches them.
    pub client: WorkerClient,
    /// Exported metrics.
    pub metrics: Arc<Metrics>,
    /// The live router policy.
    pub policy: Arc<PolicySwitch>,
    /// Compiles and validates new policy versions.
    pub policy_runtime: Arc<crate::policy::runtime::PolicyRuntime>,
    /// KV-aware routing state: prefix index, active sequences, prompt hashing.
    pub kv: Arc<crate::kv::KvState>,
    /// Where KV events and registrations that arrive over the admin API go (the applier).
    pub kv_inbound: tokio::sync::mpsc::UnboundedSender<crate::kv::sync::Inbound>,
    /// Numbers requests for policies.
    pub next_request: std::sync::atomic::AtomicU64,
}
