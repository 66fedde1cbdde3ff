//! Active health checks: `GET /healthz` on every worker at a fixed interval.
//!
//! A worker is taken out of rotation after `failures_to_eject` failed checks in a row (or at
//! once when a forwarded request cannot reach it) and brought back after
//! `successes_to_restore` passed checks in a row.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use tokio::task::JoinHandle;

use crate::config::HealthConfig;
use crate::kv::KvState;
use crate::workers::WorkerPool;
use crate::workers::client::WorkerClient;

/// Starts the health checker; it runs until the returned task is aborted.
pub fn spawn(pool: Arc<WorkerPool>, client: WorkerClient, config: HealthConfig, kv: Arc<KvState>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(Duration::from_millis(config.interval_ms));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let workers = pool.workers();
            let checks = workers.iter().map(|worker| {
                let kv = kv.clone();
                let client = client.clone();
                let worker = worker.clone();
                let config = config.clone();
                async move {
                    let request = http::Request::get(worker.uri("/healthz")).body(Full::new(Bytes::new()));
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
                        kv.worker_lost(&worker);
                    }
                }
            });
            futures_join_all(checks).await;
        }
    })
}

async fn futures_join_all<F: std::future::Future<Output = ()> + Send + 'static>(futures: impl Iterator<Item = F>) {
    let mut set = tokio::task::JoinSet::new();
    for future in futures {
        set.spawn(future);
    }
    while set.join_next().await.is_some() {}
}
