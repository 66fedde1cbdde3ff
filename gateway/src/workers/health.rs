//! Active health checks: `GET /healthz` on every worker at a fixed interval.
//!
//! A worker is taken out of rotation after `failures_to_eject` failed checks in a row (or at
//! once when a forwarded request cannot reach it) and brought back after
//! `successes_to_restore` passed checks in a row. Whoever started the checker learns of each
//! ejection through its callback (the KV index then forgets the worker's blocks).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use tokio::task::JoinHandle;

use crate::config::HealthConfig;
use crate::workers::client::WorkerClient;
use crate::workers::{Worker, WorkerPool};

/// Starts the health checker; it runs until the returned task is aborted. `ejected` is called
/// with each worker the checks take out of rotation.
pub fn spawn(
    pool: Arc<WorkerPool>,
    client: WorkerClient,
    config: HealthConfig,
    ejected: impl Fn(&Worker) + Send + Sync + 'static,
) -> JoinHandle<()> {
    let ejected = Arc::new(ejected);
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(Duration::from_millis(config.interval_ms));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let workers = pool.workers();
            let checks = workers.iter().map(|worker| {
                let ejected = ejected.clone();
                let client = client.clone();
                let worker = worker.clone();
                let config = config.clone();
                async move {
                    let request = http::Request::get(worker.uri(switchyard_protocol::paths::HEALTHZ))
                        .body(Full::new(Bytes::new()));
                    let passed = match request {
                        Ok(request) => matches!(
                            client.send_within(request, Duration::from_millis(config.timeout_ms)).await,
                            Ok(response) if response.status().is_success()
                        ),
                        Err(_) => false,
                    };
                    if passed {
                        worker.record_success(config.successes_to_restore);
                    } else if worker.record_failure(config.failures_to_eject) {
                        ejected(&worker);
                    }
                }
            });
            futures_util::future::join_all(checks).await;
        }
    })
}
