//! The worker registry: every worker the gateway may route to, and its health.
//!
//! Workers come from the configuration (and embedded mockers) at start, and — with KV events
//! over NATS — from workers that register themselves and later leave or stop heartbeating.
//! Each worker gets a `kv_id` that names it in the KV index; ids are never reused, so a worker
//! that re-registers can never inherit another's cached blocks.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use crate::config::{Role, WorkerConfig};
use crate::metrics::Metrics;
use crate::workers::breaker::{Backoffs, Breaker, BreakerState};
use crate::workers::engine::{EngineKind, EngineLoad};
use crate::workers::prefill_fit::{PrefillFit, PrefillLine};

/// One worker and its live state.
#[derive(Debug)]
pub struct Worker {
    /// Unique name (metrics label, logs, `x-switchyard-worker` header).
    pub name: String,
    /// `name` as a header value, made once (`None` if a header cannot carry it).
    name_header: Option<http::HeaderValue>,
    /// Its id in the KV index.
    pub kv_id: u32,
    /// Base URL: scheme and authority.
    pub base: http::Uri,
    /// Model served.
    pub model: String,
    /// What it does.
    pub role: Role,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Capabilities (`text`, `image`, ...).
    pub capabilities: Vec<String>,
    /// Relative token cost.
    pub cost: f64,
    /// Total KV blocks (0: unknown).
    pub capacity_blocks: u64,
    /// The machine it runs on (empty: unknown).
    pub node: String,
    /// Encoders: the token budgets it batches to, ascending.
    pub token_budgets: Vec<u32>,
    /// Spot (preemptible) capacity.
    pub spot: bool,
    /// The health path configured for it, in place of its engine's.
    health_path: Option<String>,
    /// Its engine: as configured, or as told from its answers (`None` until then).
    engine: parking_lot::Mutex<Option<EngineKind>>,
    /// Its engine's load as last read from its metrics, and until when that reading stands.
    engine_load: parking_lot::Mutex<Option<(EngineLoad, Instant)>>,
    /// Its health path answers 404.
    misconfigured: AtomicBool,
    misconfigured_gauge: Gauge,
    /// What its answers say about sending it more.
    breaker: parking_lot::Mutex<Breaker>,
    breaker_gauge: Gauge,
    busy_counter: Counter,
    metrics: Arc<Metrics>,
    healthy: AtomicBool,
    /// Its reclaim notice came: out of routing until a new instance answers in its place
    /// ([`Worker::health_passed`]).
    preempting: AtomicBool,
    /// Told when its reclaim notice comes (streams on it move elsewhere before the kill).
    reclaim_notice: tokio::sync::Notify,
    /// A health check failed after its reclaim notice: the instance noticed is gone, and one
    /// that answers later is a new one.
    gone_after_notice: AtomicBool,
    failures: AtomicU32,
    successes: AtomicU32,
    in_flight: Gauge,
    healthy_gauge: Gauge,
    /// Told each time a request on any worker of the pool ends (room may have freed).
    released: Arc<tokio::sync::Notify>,
    /// Typical gap between the chunks of its recent streams (each stream's median gap,
    /// exponentially weighted), in microseconds (0: unmeasured).
    itl_us: AtomicU32,
    /// Streams measured.
    itl_samples: AtomicU32,
    /// Its streamed requests' time to first token against the prefill work they found.
    prefill: parking_lot::Mutex<PrefillFit>,
}

impl Worker {
    fn new(
        config: &WorkerConfig,
        kv_id: u32,
        metrics: &Arc<Metrics>,
        released: Arc<tokio::sync::Notify>,
    ) -> Result<Worker, http::uri::InvalidUri> {
        let name = config.display_name();
        let worker = Worker {
            health_path: config.health_path.clone(),
            engine: parking_lot::Mutex::new(config.engine),
            engine_load: parking_lot::Mutex::new(None),
            misconfigured: AtomicBool::new(false),
            misconfigured_gauge: metrics.worker_misconfigured(&name),
            breaker: parking_lot::Mutex::new(Breaker::new(xxhash_rust::xxh3::xxh3_64(name.as_bytes()))),
            breaker_gauge: metrics.worker_breaker_state(&name),
            busy_counter: metrics.worker_busy(&name),
            metrics: metrics.clone(),
            kv_id,
            capacity_blocks: config.capacity_blocks,
            base: config.url.trim_end_matches('/').parse()?,
            model: config.model.clone(),
            role: config.role,
            block_size: config.block_size,
            capabilities: config.capabilities.clone(),
            cost: config.cost,
            node: config.node.clone(),
            token_budgets: config.token_budgets.clone(),
            spot: config.spot,
            healthy: AtomicBool::new(true),
            preempting: AtomicBool::new(false),
            reclaim_notice: tokio::sync::Notify::new(),
            gone_after_notice: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            successes: AtomicU32::new(0),
            in_flight: metrics.worker_in_flight(&name),
            healthy_gauge: metrics.worker_healthy(&name),
            released,
            itl_us: AtomicU32::new(0),
            itl_samples: AtomicU32::new(0),
            prefill: parking_lot::Mutex::new(PrefillFit::default()),
            name_header: http::HeaderValue::from_str(&name).ok(),
            name,
        };
        worker.healthy_gauge.set(1);
        worker.breaker_gauge.set(BreakerState::Closed.gauge());
        Ok(worker)
    }

    /// Its engine, if configured or told yet.
    pub fn engine(&self) -> Option<EngineKind> {
        *self.engine.lock()
    }

    /// Records the engine told from its answers.
    pub fn set_engine(&self, kind: EngineKind) {
        *self.engine.lock() = Some(kind);
    }

    /// Where its health is checked: the configured path, else its engine's (`None` while the
    /// engine is not known and no path is configured).
    pub fn health_path(&self) -> Option<String> {
        self.health_path
            .clone()
            .or_else(|| self.engine().map(|kind| kind.health_path().to_string()))
    }

    /// Takes in its engine's load as read from its metrics, standing until `until`.
    pub fn set_engine_load(&self, load: EngineLoad, until: Instant) {
        *self.engine_load.lock() = Some((load, until));
    }

    /// Its engine's load as last read, while that reading stands.
    pub fn engine_load(&self) -> Option<EngineLoad> {
        let reading = *self.engine_load.lock();
        reading.and_then(|(load, until)| (Instant::now() < until).then_some(load))
    }

    /// Requests at the worker: the most of `tracked` (the gateway's active-sequence count),
    /// this gateway's own in-flight count (it covers requests the tracker does not, e.g.
    /// retries) and, for an engine that reports its load, the engine's running and waiting
    /// requests (which count what other gateways and clients sent it too).
    pub fn requests(&self, tracked: u32) -> u64 {
        let in_flight = u64::try_from(self.in_flight()).unwrap_or(0);
        let engine = self.engine_load().map_or(0, |load| load.requests());
        u64::from(tracked).max(in_flight).max(engine)
    }

    /// Records whether its health path answers 404; returns whether that is news.
    pub fn set_misconfigured(&self, misconfigured: bool) -> bool {
        self.misconfigured_gauge.set(i64::from(misconfigured));
        self.misconfigured.swap(misconfigured, Ordering::Relaxed) != misconfigured
    }

    /// Whether its health path answers 404.
    pub fn is_misconfigured(&self) -> bool {
        self.misconfigured.load(Ordering::Relaxed)
    }

    /// Whether a request may be sent to it now: in rotation, its breaker not open (or its
    /// backoff over) and not in a busy backoff.
    pub fn is_routable(&self) -> bool {
        self.is_healthy() && self.breaker.lock().would_admit(Instant::now())
    }

    /// A request was routed to it: a half-open breaker lets this one through as its probe.
    pub fn take_turn(&self) {
        let (_, change) = self.breaker.lock().admits(Instant::now());
        if let Some(state) = change {
            self.breaker_changed(state);
        }
    }

    /// Whether it is in a busy backoff (it answered 429 or 503 lately).
    pub fn is_busy(&self) -> bool {
        self.breaker.lock().is_busy(Instant::now())
    }

    /// Where its breaker is.
    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.lock().state()
    }

    /// It answered: its breaker closes, its busy backoff ends.
    pub fn answered(&self) {
        let change = self.breaker.lock().succeeded();
        if let Some(state) = change {
            self.breaker_changed(state);
        }
    }

    /// It failed an answer (a 5xx other than 503, a timeout, a stream broken before its first
    /// byte). Returns for how long its breaker opened, if it did.
    pub fn failed_answer(&self, backoffs: &Backoffs) -> Option<Duration> {
        let change = self.breaker.lock().failed(Instant::now(), backoffs);
        let (state, backoff) = change?;
        self.breaker_changed(state);
        tracing::warn!(worker = %self.name, backoff_ms = backoff.as_millis() as u64, "circuit breaker open: failed answers in a row");
        Some(backoff)
    }

    /// It answered 429 or 503: busy for `retry_after` or its next busy backoff. Returns how
    /// long.
    pub fn busy(&self, retry_after: Option<Duration>, backoffs: &Backoffs) -> Duration {
        self.busy_counter.inc();
        self.breaker.lock().busy(Instant::now(), retry_after, backoffs)
    }

    fn breaker_changed(&self, state: BreakerState) {
        self.breaker_gauge.set(state.gauge());
        self.metrics.worker_breaker_transition(&self.name, state.name());
        // In rotation as far as the metrics tell: healthy and the breaker not open.
        let in_rotation = state == BreakerState::Closed && self.is_healthy();
        self.healthy_gauge.set(i64::from(in_rotation));
        match state {
            // Logged with its backoff where it opens.
            BreakerState::Open => {}
            BreakerState::HalfOpen => {
                tracing::info!(worker = %self.name, "circuit breaker half open: one probe request")
            }
            BreakerState::Closed => tracing::info!(worker = %self.name, "circuit breaker closed"),
        }
    }

    /// Takes in one stream's median gap between chunks: an exponentially weighted mean, the
    /// newest stream weighing a fifth.
    pub fn observe_itl(&self, itl_ms: f64) {
        let sample = (itl_ms * 1000.0).clamp(1.0, f64::from(u32::MAX)) as u32;
        let before = self.itl_us.load(Ordering::Relaxed);
        let mean = if before == 0 {
            sample
        } else {
            ((f64::from(before) * 0.8) + (f64::from(sample) * 0.2)) as u32
        };
        self.itl_us.store(mean.max(1), Ordering::Relaxed);
        self.itl_samples.fetch_add(1, Ordering::Relaxed);
    }

    /// The measured typical gap between chunks (µs, 0 while unmeasured) and the streams behind
    /// it.
    pub fn measured_itl(&self) -> (u32, u32) {
        (
            self.itl_us.load(Ordering::Relaxed),
            self.itl_samples.load(Ordering::Relaxed),
        )
    }

    /// Takes in one streamed request that found `work_tokens` of prefill work here (its own
    /// uncached tokens included) and reached its first token `ttft_ms` after it was routed.
    pub fn observe_prefill(&self, work_tokens: u64, ttft_ms: f64) {
        self.prefill.lock().observe(work_tokens, ttft_ms);
    }

    /// The line fitted to its requests' prefill so far (see [`PrefillFit`]; `None` while it
    /// is not determined), and the requests taken in.
    pub fn measured_prefill(&self) -> (Option<PrefillLine>, u32) {
        let fit = self.prefill.lock();
        (fit.line(), fit.samples())
    }

    /// Whether the worker is in rotation: healthy and not being preempted.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.preempting.load(Ordering::Relaxed)
    }

    /// Whether its reclaim notice came.
    pub fn is_preempting(&self) -> bool {
        self.preempting.load(Ordering::Relaxed)
    }

    /// Takes the worker out of routing until a new instance replaces it: its reclaim notice
    /// came (spot capacity about to be taken away). Requests in flight on it go on while it
    /// lasts (or move elsewhere, see `forwarding.migration_limit`); those that break before
    /// their first byte are retried elsewhere. Returns whether this is news.
    pub fn preempt(&self) -> bool {
        if self.preempting.swap(true, Ordering::Relaxed) {
            return false;
        }
        self.healthy_gauge.set(0);
        tracing::warn!(worker = %self.name, in_flight = self.in_flight(), "reclaim notice: worker out of routing");
        self.reclaim_notice.notify_waiters();
        true
    }

    /// A health check failed: after a reclaim notice, the instance noticed is taken to be gone.
    pub fn health_failed(&self) {
        if self.is_preempting() {
            self.gone_after_notice.store(true, Ordering::Relaxed);
        }
    }

    /// A health check passed: after a reclaim notice and a failed check, a new instance took
    /// the reclaimed one's place (same name and address, as a restarted pod or VM has), and
    /// routing may use it again. Returns whether it came back so.
    pub fn health_passed(&self) -> bool {
        if !self.is_preempting() || !self.gone_after_notice.swap(false, Ordering::Relaxed) {
            return false;
        }
        self.preempting.store(false, Ordering::Relaxed);
        self.healthy_gauge.set(i64::from(
            self.healthy.load(Ordering::Relaxed) && self.breaker_state() == BreakerState::Closed,
        ));
        tracing::info!(worker = %self.name, "a new instance answers in place of the reclaimed one: back in routing");
        true
    }

    /// Returns once its reclaim notice has come (at once if it already has).
    pub async fn reclaimed(&self) {
        let notified = self.reclaim_notice.notified();
        tokio::pin!(notified);
        // Registered before the flag is read, so a notice between the two is not missed.
        notified.as_mut().enable();
        if self.is_preempting() {
            return;
        }
        notified.await;
    }

    /// Requests in flight on this worker through this gateway.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.get()
    }

    /// Its name as a header value (`None` if a header cannot carry it); cloning it allocates
    /// nothing.
    pub fn name_header(&self) -> Option<http::HeaderValue> {
        self.name_header.clone()
    }

    /// The URI of an endpoint of this worker: [`Worker::uri`] without copying the path, for
    /// the request path.
    pub fn endpoint_uri(&self, path: &'static str) -> http::Uri {
        self.with_path(http::uri::PathAndQuery::from_static(path))
    }

    /// The URI of `path` on this worker.
    pub fn uri(&self, path: &str) -> http::Uri {
        self.with_path(
            http::uri::PathAndQuery::from_maybe_shared(bytes::Bytes::copy_from_slice(path.as_bytes()))
                .unwrap_or_else(|_| http::uri::PathAndQuery::from_static("/")),
        )
    }

    /// The base URL with `path_and_query` in place of its own.
    fn with_path(&self, path_and_query: http::uri::PathAndQuery) -> http::Uri {
        let mut parts = self.base.clone().into_parts();
        parts.path_and_query = Some(path_and_query);
        http::Uri::from_parts(parts).unwrap_or_else(|_| self.base.clone())
    }

    /// Takes the worker out of rotation at once (a request could not reach it). Returns
    /// whether it was in rotation until now.
    pub fn eject(&self) -> bool {
        self.successes.store(0, Ordering::Relaxed);
        if self.healthy.swap(false, Ordering::Relaxed) {
            self.healthy_gauge.set(0);
            tracing::warn!(worker = %self.name, "worker out of rotation");
            return true;
        }
        false
    }

    /// Records a failed health check; ejects after `threshold` in a row. Returns whether the
    /// worker left the rotation now.
    pub fn record_failure(&self, threshold: u32) -> bool {
        self.successes.store(0, Ordering::Relaxed);
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        failures >= threshold && self.eject()
    }

    /// Records a passed health check; restores after `threshold` in a row.
    pub fn record_success(&self, threshold: u32) {
        self.failures.store(0, Ordering::Relaxed);
        let successes = self.successes.fetch_add(1, Ordering::Relaxed) + 1;
        if successes >= threshold && !self.healthy.swap(true, Ordering::Relaxed) && !self.is_preempting() {
            self.healthy_gauge
                .set(i64::from(self.breaker_state() == BreakerState::Closed));
            tracing::info!(worker = %self.name, "worker back in rotation");
        }
    }
}

/// Counts a request as in flight on a worker until dropped.
#[derive(Debug)]
pub struct InFlight {
    worker: Arc<Worker>,
}

impl InFlight {
    /// Starts counting a request on `worker`.
    pub fn new(worker: Arc<Worker>) -> InFlight {
        worker.in_flight.inc();
        InFlight { worker }
    }

    /// The worker.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.in_flight.dec();
        self.worker.released.notify_one();
    }
}

/// Every worker: configured, embedded, or registered.
#[derive(Debug)]
pub struct WorkerPool {
    workers: RwLock<Arc<Vec<Arc<Worker>>>>,
    next_kv_id: AtomicU32,
    metrics: Arc<Metrics>,
    released: Arc<tokio::sync::Notify>,
}

impl WorkerPool {
    /// Builds the pool from validated worker entries.
    ///
    /// # Errors
    ///
    /// Returns the invalid URI of a worker whose URL does not parse (validation prevents it).
    pub fn new(configs: &[WorkerConfig], metrics: Arc<Metrics>) -> Result<WorkerPool, http::uri::InvalidUri> {
        let pool = WorkerPool {
            workers: RwLock::new(Arc::new(Vec::new())),
            next_kv_id: AtomicU32::new(0),
            metrics,
            released: Arc::new(tokio::sync::Notify::new()),
        };
        for config in configs {
            pool.upsert(config)?;
        }
        Ok(pool)
    }

    /// Told each time a request in flight on a worker ends: where the admission queue learns
    /// that room may have freed.
    pub fn released(&self) -> &Arc<tokio::sync::Notify> {
        &self.released
    }

    /// Every worker, as of now.
    pub fn workers(&self) -> Arc<Vec<Arc<Worker>>> {
        self.workers
            .read()
            .map(|w| w.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    fn replace(&self, update: impl FnOnce(&mut Vec<Arc<Worker>>)) {
        let mut guard = self.workers.write().unwrap_or_else(|p| p.into_inner());
        let mut workers = guard.as_ref().clone();
        update(&mut workers);
        *guard = Arc::new(workers);
    }

    /// Adds a worker, or returns the one of the same name if it is described the same way
    /// (`false`); a changed description replaces it with a fresh worker under a new `kv_id`
    /// (`true`, as for a new one).
    ///
    /// # Errors
    ///
    /// Returns the invalid URI if the worker's URL does not parse.
    pub fn upsert(&self, config: &WorkerConfig) -> Result<(Arc<Worker>, bool), http::uri::InvalidUri> {
        let name = config.display_name();
        if let Some(existing) = self.by_name(&name)
            && existing.base == config.url.trim_end_matches('/').parse::<http::Uri>()?
            && existing.model == config.model
            && existing.block_size == config.block_size
            && existing.role == config.role
        {
            return Ok((existing, false));
        }
        let kv_id = self.next_kv_id.fetch_add(1, Ordering::Relaxed);
        let worker = Arc::new(Worker::new(config, kv_id, &self.metrics, self.released.clone())?);
        let added = worker.clone();
        self.replace(|workers| {
            workers.retain(|w| w.name != name);
            workers.push(added);
        });
        Ok((worker, true))
    }

    /// Takes `worker` out of routing on its reclaim notice (see [`Worker::preempt`]),
    /// counted once.
    pub fn preempt(&self, worker: &Worker) {
        if worker.preempt() {
            self.metrics.preemption();
        }
    }

    /// Removes the worker named `name`, returning it.
    pub fn remove(&self, name: &str) -> Option<Arc<Worker>> {
        let removed = self.by_name(name)?;
        removed.healthy_gauge.set(0);
        removed.healthy.store(false, Ordering::Relaxed);
        self.replace(|workers| workers.retain(|w| w.name != name));
        Some(removed)
    }

    /// The worker named `name`.
    pub fn by_name(&self, name: &str) -> Option<Arc<Worker>> {
        self.workers().iter().find(|w| w.name == name).cloned()
    }

    /// The distinct models served, sorted.
    pub fn models(&self) -> Vec<String> {
        let mut models: Vec<String> = self
            .workers()
            .iter()
            .filter(|w| w.role.is_llm())
            .map(|w| w.model.clone())
            .collect();
        models.sort_unstable();
        models.dedup();
        models
    }

    /// Whether any LLM worker serves `model`, healthy or not.
    pub fn serves(&self, model: &str) -> bool {
        self.workers().iter().any(|w| w.role.is_llm() && w.model == model)
    }

    /// Whether any worker is in rotation.
    pub fn any_healthy(&self) -> bool {
        self.workers().iter().any(|w| w.is_healthy())
    }

    /// The LLM workers of `model` a request may go to now (see [`Worker::is_routable`]),
    /// skipping those in `exclude`, in registration order.
    pub fn candidates(&self, model: &str, exclude: &[u32]) -> Vec<Arc<Worker>> {
        self.workers()
            .iter()
            .filter(|w| w.role.generates() && w.model == model && w.is_routable())
            .filter(|w| !exclude.contains(&w.kv_id))
            .cloned()
            .collect()
    }

    /// The prefill workers of `model` a prompt may go to now, in registration order.
    pub fn prefill_candidates(&self, model: &str) -> Vec<Arc<Worker>> {
        self.workers()
            .iter()
            .filter(|w| w.role == Role::Prefill && w.model == model && w.is_routable())
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(i: usize) -> WorkerConfig {
        WorkerConfig {
            name: Some(format!("w{i}")),
            url: format!("http://127.0.0.1:{}", 9000 + i),
            model: "m".into(),
            role: Role::Llm,
            block_size: 64,
            capabilities: vec!["text".into()],
            cost: 1.0,
            capacity_blocks: 0,
            node: String::new(),
            token_budgets: Vec::new(),
            spot: false,
            engine: None,
            health_path: None,
        }
    }

    fn pool(n: usize) -> WorkerPool {
        let configs: Vec<WorkerConfig> = (0..n).map(config).collect();
        WorkerPool::new(&configs, Arc::new(Metrics::new())).expect("valid urls")
    }

    #[test]
    fn candidates_are_the_healthy_untried_workers_of_the_model() {
        let pool = pool(3);
        let names = |workers: Vec<Arc<Worker>>| workers.iter().map(|w| w.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(pool.candidates("m", &[])), ["w0", "w1", "w2"]);
        pool.workers()[2].eject();
        assert_eq!(names(pool.candidates("m", &[])), ["w0", "w1"]);
        assert_eq!(names(pool.candidates("m", &[pool.workers()[0].kv_id])), ["w1"]);
        assert!(pool.candidates("other", &[]).is_empty());
    }

    #[test]
    fn registration_adds_replaces_and_removes() {
        let pool = pool(2);
        let mut config = config(1);
        let (same, changed) = pool.upsert(&config).expect("valid");
        assert!(!changed);
        assert_eq!(same.kv_id, 1);
        config.url = "http://127.0.0.1:9100".into();
        let (moved, changed) = pool.upsert(&config).expect("valid");
        assert!(changed);
        assert_eq!(moved.kv_id, 2, "ids are never reused");
        assert_eq!(pool.workers().len(), 2);
        assert!(pool.remove("w1").is_some());
        assert!(pool.by_name("w1").is_none());
        assert!(!moved.is_healthy());
    }

    #[test]
    fn health_thresholds_eject_and_restore() {
        let pool = pool(1);
        let worker = &pool.workers()[0];
        worker.record_failure(2);
        assert!(worker.is_healthy());
        worker.record_failure(2);
        assert!(!worker.is_healthy());
        worker.record_success(2);
        assert!(!worker.is_healthy());
        worker.record_success(2);
        assert!(worker.is_healthy());
    }

    #[tokio::test]
    async fn a_reclaimed_worker_routes_again_only_once_a_new_instance_answers() {
        let pool = pool(1);
        let worker = pool.workers()[0].clone();
        let waiting = tokio::spawn({
            let worker = worker.clone();
            async move { worker.reclaimed().await }
        });
        tokio::task::yield_now().await;
        pool.preempt(&worker);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the notice wakes whoever waits for it")
            .expect("joined");
        assert!(!worker.is_healthy());
        assert!(
            !worker.health_passed(),
            "a pass before the noticed instance is gone is its own"
        );
        assert!(!worker.is_healthy());
        worker.health_failed();
        assert!(worker.health_passed(), "then a pass is a new instance");
        assert!(worker.is_healthy());
        // Waiting for a notice that already came returns at once; a new one is waited for.
        pool.preempt(&worker);
        worker.reclaimed().await;
    }

    #[test]
    fn in_flight_is_counted_until_dropped() {
        let pool = pool(1);
        let guard = InFlight::new(pool.workers()[0].clone());
        assert_eq!(pool.workers()[0].in_flight(), 1);
        drop(guard);
        assert_eq!(pool.workers()[0].in_flight(), 0);
        assert_eq!(
            pool.workers()[0].uri("/v1/models").to_string(),
            "http://127.0.0.1:9000/v1/models"
        );
    }
}
