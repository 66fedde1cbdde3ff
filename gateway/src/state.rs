//! What every request handler shares: configuration, workers, the worker client, metrics.

use std::sync::Arc;

use crate::config::Config;
use crate::metrics::Metrics;
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
}
