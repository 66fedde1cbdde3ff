//! Active health checks and engine load: every worker is visited at a fixed interval.
//!
//! A visit first tells the worker's engine if neither the configuration nor an earlier visit
//! has ([`EngineKind::from_metrics`], then [`EngineKind::from_models`], then which of `/health`
//! and `/healthz` answers), and logs what it found. It then checks the engine's health path
//! (`health_path`, else the engine's own). A worker is taken out of rotation after
//! `failures_to_eject` failed checks in a row (or at once when a forwarded request cannot reach
//! it) and brought back after `successes_to_restore` passed checks in a row. A health path that
//! answers 404 is a configuration mistake, not a failing engine: the worker is reported as
//! misconfigured (a log line naming the path, and `switchyard_worker_misconfigured`) and is
//! left in rotation, watched by its answers' circuit breaker. Last, an engine that reports its
//! load ([`EngineKind::reports_load`]) has its `/metrics` read into [`EngineLoad`], which the
//! routing table folds into its columns; a reading stands for three intervals.
//!
//! A 503 whose error code is `preempting` is a spot worker's reclaim notice (how a worker
//! linked over HTTP gives it; over NATS it comes with its registration): the worker leaves
//! routing and the streams on it move elsewhere ([`WorkerPool::preempt`]). It stays out until,
//! after a failed check (the reclaimed instance gone), a check passes: a new instance at the
//! same address.
//!
//! Whoever started the checker learns of each ejection through its callback (the KV index then
//! forgets the worker's blocks).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full, Limited};
use switchyard_protocol::paths;
use tokio::task::JoinHandle;

use crate::config::HealthConfig;
use crate::workers::client::WorkerClient;
use crate::workers::engine::{EngineKind, EngineLoad};
use crate::workers::{Worker, WorkerPool};

/// The most of a worker's `/metrics` or `/v1/models` read (engines' metrics are tens of KiB).
const MAX_BODY: usize = 4 << 20;

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
            let visits = workers.iter().map(|worker| {
                let visit = Visit {
                    pool: pool.clone(),
                    worker: worker.clone(),
                    client: client.clone(),
                    config: config.clone(),
                };
                let ejected = ejected.clone();
                async move { visit.run(&*ejected).await }
            });
            futures_util::future::join_all(visits).await;
        }
    })
}

/// One visit of one worker.
struct Visit {
    pool: Arc<WorkerPool>,
    worker: Arc<Worker>,
    client: WorkerClient,
    config: HealthConfig,
}

/// What a `GET` got: the status and, for a success, the body (`None`: no answer at all).
type Fetched = Option<(StatusCode, Bytes)>;

impl Visit {
    async fn run(&self, ejected: &(dyn Fn(&Worker) + Send + Sync)) {
        let worker = &self.worker;
        // The metrics a detection read serve this visit's load reading too.
        let metrics = if worker.engine().is_none() {
            self.detect().await
        } else {
            None
        };
        let answer = match worker.health_path() {
            Some(path) => self.get(&path).await,
            // Nothing answered any of the ways an engine is told.
            None => None,
        };
        if let Some((StatusCode::SERVICE_UNAVAILABLE, body)) = &answer
            && serde_json::from_slice::<switchyard_protocol::api::ErrorBody>(body)
                .is_ok_and(|error| error.error.code.as_deref() == Some("preempting"))
        {
            self.pool.preempt(worker);
        }
        match answer.map(|(status, _)| status) {
            Some(status) if status.is_success() => {
                worker.health_passed();
                if worker.set_misconfigured(false) {
                    tracing::info!(worker = %worker.name, "the worker's health path answers again");
                }
                worker.record_success(self.config.successes_to_restore);
            }
            Some(StatusCode::NOT_FOUND) => {
                worker.health_failed();
                let path = worker.health_path().unwrap_or_default();
                if worker.set_misconfigured(true) {
                    tracing::error!(
                        worker = %worker.name,
                        engine = worker.engine().map_or("unknown", EngineKind::name),
                        path = %path,
                        "the worker's health path answers 404: set `health_path` in its [[workers]] entry to the path its engine serves; until then only its answers tell whether it is healthy"
                    );
                }
            }
            _ => {
                worker.health_failed();
                if worker.record_failure(self.config.failures_to_eject) {
                    ejected(worker);
                }
            }
        }
        if worker.engine().is_some_and(EngineKind::reports_load) {
            self.read_load(metrics).await;
        }
    }

    /// Tells the worker's engine from its answers, and logs what it found; answers the
    /// worker's `/metrics` text when it served one.
    async fn detect(&self) -> Option<Bytes> {
        let worker = &self.worker;
        let metrics = match self.get(paths::METRICS).await {
            Some((status, body)) if status.is_success() => Some(body),
            Some(_) => None,
            // Nothing answers: the other probes would only wait their timeouts too.
            None => return None,
        };
        let found = metrics.as_ref().and_then(|body| {
            EngineKind::from_metrics(&String::from_utf8_lossy(body)).map(|kind| (kind, "its metric names"))
        });
        let found = match found {
            Some(found) => Some(found),
            None => match self.get(switchyard_protocol::api::MODELS_PATH).await {
                Some((status, body)) if status.is_success() => {
                    EngineKind::from_models(&body).map(|kind| (kind, "the owner its /v1/models names"))
                }
                _ => None,
            },
        };
        let found = match found {
            Some(found) => Some(found),
            None if self.answers(paths::HEALTH).await => Some((EngineKind::Openai, "its /health answering")),
            None if self.answers(paths::HEALTHZ).await => Some((EngineKind::Switchyard, "its /healthz answering")),
            None => None,
        };
        if let Some((kind, how)) = found {
            worker.set_engine(kind);
            tracing::info!(worker = %worker.name, engine = kind.name(), from = how, "told the worker's engine");
        }
        metrics
    }

    /// Reads the engine's load from its metrics (`read`, else fetched now); a worker whose
    /// metrics cannot be read keeps its last reading until it lapses.
    async fn read_load(&self, read: Option<Bytes>) {
        let Some(kind) = self.worker.engine() else { return };
        let body = match read {
            Some(body) => body,
            None => match self.get(paths::METRICS).await {
                Some((status, body)) if status.is_success() => body,
                _ => return,
            },
        };
        let text = String::from_utf8_lossy(&body);
        if let Some(load) = EngineLoad::read(kind, &text, self.worker.block_size) {
            let stands = Duration::from_millis(self.config.interval_ms.saturating_mul(3));
            self.worker.set_engine_load(load, Instant::now() + stands);
        }
    }

    async fn answers(&self, path: &str) -> bool {
        self.get(path).await.is_some_and(|(status, _)| status.is_success())
    }

    /// `GET path` on the worker within the check timeout: its status and (up to [`MAX_BODY`])
    /// its body.
    async fn get(&self, path: &str) -> Fetched {
        let timeout = Duration::from_millis(self.config.timeout_ms);
        let request = http::Request::get(self.worker.uri(path))
            .body(Full::new(Bytes::new()))
            .ok()?;
        let response = self.client.send_within(request, timeout).await.ok()?;
        let status = response.status();
        let body = tokio::time::timeout(timeout, Limited::new(response.into_body(), MAX_BODY).collect())
            .await
            .ok()
            .and_then(Result::ok)
            .map(|collected| collected.to_bytes())
            .unwrap_or_default();
        Some((status, body))
    }
}
