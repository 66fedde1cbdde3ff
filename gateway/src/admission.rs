//! The admission queue: requests wait in the gateway while every worker of their model is full,
//! and leave in the order a batcher policy chooses as room frees.
//!
//! A worker is full by the thresholds of `[admission]` (requests in flight, the share of its KV
//! blocks that active requests hold, prompt tokens routed and not yet prefilled). A request
//! whose model has a worker with room, and no request waiting before it, goes on at once;
//! otherwise it waits ([`Admission::enter`]). Whenever a request on a worker ends (and every
//! few milliseconds while requests wait, as KV events and health change room too), a pass asks
//! the admission batcher — the `batcher` world, as at the encoder queues, with each request's
//! tenant and weight — which of the waiting requests take the room there is now: one batch of
//! at most that many, in order. The batcher chooses order only: how many leave is the host's
//! (a batch short of the room is topped up first come, first served), and an answer that
//! breaks the contract is replaced by first come, first served (higher priority classes
//! first), so a hostile batcher can neither hold requests back nor let more through.
//! A request admitted holds a reservation until it has its worker, so one pass's room is not
//! handed out twice. A pass hands the reservation itself to the waiting request, through its
//! channel: if the client left just as it was admitted, the reservation is dropped with the
//! channel and its room comes back. A waiting request whose client went away is dropped at the
//! next pass and never reaches a worker. The queue is bounded in total and per tenant (its
//! requests for every model counted together; 429 when full), and a wait is bounded by
//! `max_wait_ms` (503).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::StatusCode;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use switchyard_protocol::api::ApiError;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::AdmissionConfig;
use crate::kv::KvState;
use crate::policy::batching::{BatcherSwitch, Budget, PendingTable, Tenancy, fallback};
use crate::tenants::Grant;
use crate::workers::WorkerPool;

/// How often waiting requests are reconsidered when no request has ended.
const TICK: Duration = Duration::from_millis(10);

type Labels = Vec<(&'static str, String)>;

/// The queue's metric families.
#[derive(Debug, Clone)]
pub(crate) struct AdmissionMetrics {
    wait: Family<Labels, Histogram, fn() -> Histogram>,
    depth: Family<Labels, Gauge>,
    outcomes: Family<Labels, Counter>,
}

impl Default for AdmissionMetrics {
    fn default() -> AdmissionMetrics {
        AdmissionMetrics {
            wait: Family::new_with_constructor(wait_histogram),
            depth: Family::default(),
            outcomes: Family::default(),
        }
    }
}

impl AdmissionMetrics {
    /// Registers the queue's metrics, and its batcher's, under `switchyard_admission_`; the
    /// wait by tenant among the families labelled by tenant (the admin listener's only).
    pub(crate) fn register(&self, metrics: &mut crate::metrics::Metrics, batchers: &BatcherSwitch) {
        metrics
            .tenant_registry_mut()
            .sub_registry_with_prefix("admission")
            .register(
                "wait_seconds",
                "Time requests waited in the admission queue before a worker had room, by tenant",
                self.wait.clone(),
            );
        let registry = metrics.registry_mut().sub_registry_with_prefix("admission");
        registry.register(
            "queue_depth",
            "Requests waiting in the admission queue, by model",
            self.depth.clone(),
        );
        registry.register(
            "requests",
            "Requests through the admission queue, by outcome (direct, queued, full, timed_out, abandoned)",
            self.outcomes.clone(),
        );
        batchers.register_metrics(registry);
    }
}

fn wait_histogram() -> Histogram {
    // 1 ms .. ~65 s, doubling.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 17,
    ))
}

/// One request waiting.
#[derive(Debug)]
struct Waiter {
    id: u64,
    tenant: String,
    tenant_number: u32,
    priority: u8,
    weight: f32,
    tokens: u32,
    since: Instant,
    /// Takes the request's reservation when a pass admits it. The reservation itself goes
    /// through the channel: one its receiver never takes (the client left after the pass, before
    /// its request ran again) is dropped with the channel and gives its room back.
    wake: oneshot::Sender<Reservation>,
}

/// The requests of one model waiting, and those admitted that have no worker yet.
#[derive(Debug, Default)]
struct ModelQueue {
    waiters: Vec<Waiter>,
    reserved: usize,
}

/// What a request brings to the queue.
#[derive(Debug)]
pub(crate) struct Ticket<'a> {
    /// The caller's key, when the gateway has keys.
    pub(crate) grant: Option<&'a Grant>,
    /// The prompt's tokens.
    pub(crate) tokens: usize,
}

/// The admission queue of a gateway (inert without `[admission]`).
#[derive(Debug)]
pub(crate) struct Admission {
    config: Option<AdmissionConfig>,
    pool: Arc<WorkerPool>,
    kv: Arc<KvState>,
    batchers: Arc<BatcherSwitch>,
    queues: Mutex<HashMap<String, ModelQueue>>,
    next_id: AtomicU64,
    /// Tenants as the small numbers batchers see, in order of first appearance.
    tenant_numbers: Mutex<HashMap<String, u32>>,
    metrics: AdmissionMetrics,
}

/// A request let through: it holds its place in its model's room until dropped (once it has
/// its worker, or has failed, or was never taken from the waiter's channel).
#[derive(Debug)]
pub(crate) struct Reservation {
    held: Option<(Arc<Admission>, String)>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some((admission, model)) = self.held.take() {
            if let Some(queue) = admission.queues.lock().get_mut(&model) {
                queue.reserved = queue.reserved.saturating_sub(1);
            }
            admission.pool.released().notify_one();
        }
    }
}

impl Admission {
    /// The queue `config` describes (none: inert), ordered by `batchers`.
    pub(crate) fn new(
        config: Option<AdmissionConfig>,
        pool: Arc<WorkerPool>,
        kv: Arc<KvState>,
        batchers: Arc<BatcherSwitch>,
        metrics: AdmissionMetrics,
    ) -> Admission {
        Admission {
            config,
            pool,
            kv,
            batchers,
            queues: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            tenant_numbers: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// The batcher that orders the queue.
    pub(crate) fn batchers(&self) -> &Arc<BatcherSwitch> {
        &self.batchers
    }

    fn count(&self, outcome: &str) {
        self.metrics
            .outcomes
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
    }

    /// How many more requests the healthy workers of `model` take now; `None` when the model
    /// has no healthy worker (routing answers that).
    fn room(&self, config: &AdmissionConfig, model: &str) -> Option<usize> {
        let workers = self.pool.candidates(model, &[]);
        if workers.is_empty() {
            return None;
        }
        let loads = self.kv.loads(workers.iter().map(|w| w.kv_id));
        let room = workers
            .iter()
            .zip(loads)
            .map(|(worker, load)| {
                // An engine that reports its own load counts what others sent it too.
                let engine = worker.engine_load();
                let requests = worker.requests(load.requests);
                let kv_full = config.max_kv_usage.is_some_and(|share| {
                    let engine_usage = engine.and_then(|engine| engine.kv_usage).unwrap_or(0.0);
                    engine_usage >= share
                        || (worker.capacity_blocks > 0
                            && f64::from(load.active_blocks) >= share * worker.capacity_blocks as f64)
                });
                let prefill_full = config.max_prefill_tokens.is_some_and(|max| load.prefill_tokens >= max);
                match config.max_requests {
                    _ if kv_full || prefill_full => 0,
                    Some(max) => u64::from(max).saturating_sub(requests) as usize,
                    None => 1,
                }
            })
            .sum();
        Some(room)
    }

    /// Lets a request for `model` through, at once or after waiting its turn.
    ///
    /// # Errors
    ///
    /// 429 (`queue_full`) when the queue or the tenant's share of it is full; 503
    /// (`queue_timeout`) after `max_wait_ms`.
    pub(crate) async fn enter(self: &Arc<Self>, model: &str, ticket: Ticket<'_>) -> Result<Reservation, ApiError> {
        let Some(config) = &self.config else {
            return Ok(Reservation { held: None });
        };
        let Some(room) = self.room(config, model) else {
            return Ok(Reservation { held: None });
        };
        let tenant = ticket.grant.map_or("", Grant::tenant).to_string();
        let admitted = || Reservation {
            held: Some((self.clone(), model.to_string())),
        };
        let (id, receiver) = {
            let mut queues = self.queues.lock();
            let waiting_total: usize = queues.values().map(|q| q.waiters.len()).sum();
            let queue = queues.entry(model.to_string()).or_default();
            queue.waiters.retain(|waiter| !waiter.wake.is_closed());
            if queue.waiters.is_empty() && room > queue.reserved {
                queue.reserved += 1;
                drop(queues);
                self.count("direct");
                return Ok(admitted());
            }
            // A tenant's share of the queue counts its requests for every model.
            let tenant_waiting: usize = queues
                .values()
                .map(|queue| queue.waiters.iter().filter(|w| w.tenant == tenant).count())
                .sum();
            if waiting_total >= config.max_queue || tenant_waiting >= config.max_queue_per_tenant {
                drop(queues);
                self.count("full");
                let whose = if waiting_total >= config.max_queue {
                    format!("the gateway's admission queue is full ({} requests)", config.max_queue)
                } else {
                    format!(
                        "tenant `{tenant}` already has {} requests waiting",
                        config.max_queue_per_tenant
                    )
                };
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "requests",
                    "queue_full",
                    format!("every worker of model `{model}` is busy and {whose}; try again shortly"),
                )
                .with_retry_after(Duration::from_secs(1)));
            }
            let queue = queues.entry(model.to_string()).or_default();
            let (wake, receiver) = oneshot::channel();
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let tenant_number = self.tenant_number(&tenant);
            queue.waiters.push(Waiter {
                id,
                tenant: tenant.clone(),
                tenant_number,
                priority: ticket.grant.map_or(0, Grant::priority),
                weight: ticket.grant.map_or(1.0, |grant| grant.weight() as f32),
                tokens: u32::try_from(ticket.tokens).unwrap_or(u32::MAX),
                since: Instant::now(),
                wake,
            });
            self.metrics
                .depth
                .get_or_create(&vec![("model", model.to_string())])
                .set(queue.waiters.len() as i64);
            (id, receiver)
        };
        self.pool.released().notify_one();
        let started = Instant::now();
        let mut receiver = receiver;
        let outcome = tokio::time::timeout(Duration::from_millis(config.max_wait_ms), &mut receiver).await;
        let admitted_now = match outcome {
            Ok(Ok(reservation)) => Some(reservation),
            // The sender went without a word: the queue dropped the request (never happens
            // while the receiver lives, but it is not an admission).
            Ok(Err(_)) => None,
            Err(_) => {
                // Timed out; a pass may have admitted it at the same moment.
                let mut queues = self.queues.lock();
                if let Some(queue) = queues.get_mut(model) {
                    queue.waiters.retain(|waiter| waiter.id != id);
                }
                drop(queues);
                receiver.try_recv().ok()
            }
        };
        if let Some(reservation) = admitted_now {
            self.metrics
                .wait
                .get_or_create(&vec![("tenant", tenant)])
                .observe(started.elapsed().as_secs_f64());
            self.count("queued");
            return Ok(reservation);
        }
        self.count("timed_out");
        Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "queue_timeout",
            format!(
                "every worker of model `{model}` stayed busy for {} ms (admission.max_wait_ms); try again later",
                config.max_wait_ms
            ),
        )
        .with_retry_after(Duration::from_secs(1)))
    }

    fn tenant_number(&self, tenant: &str) -> u32 {
        if tenant.is_empty() {
            return 0;
        }
        let mut numbers = self.tenant_numbers.lock();
        let next = u32::try_from(numbers.len() + 1).unwrap_or(u32::MAX);
        *numbers.entry(tenant.to_string()).or_insert(next)
    }

    /// Runs passes over the waiting requests until the returned task is aborted.
    pub(crate) fn spawn(self: &Arc<Self>) -> Option<JoinHandle<()>> {
        self.config.as_ref()?;
        let admission = self.clone();
        Some(tokio::spawn(async move {
            let released = admission.pool.released().clone();
            loop {
                if admission.waiting() {
                    tokio::select! {
                        () = released.notified() => {}
                        () = tokio::time::sleep(TICK) => {}
                    }
                } else {
                    released.notified().await;
                }
                admission.pass().await;
            }
        }))
    }

    /// Requests waiting now, by tenant (`""` without keys).
    pub(crate) fn waiting_by_tenant(&self) -> HashMap<String, usize> {
        let mut waiting = HashMap::new();
        for queue in self.queues.lock().values() {
            for waiter in &queue.waiters {
                *waiting.entry(waiter.tenant.clone()).or_insert(0) += 1;
            }
        }
        waiting
    }

    /// Per model with a queue: the requests waiting, the reservations held (admitted, no
    /// worker yet) and the room its healthy workers have now (`None` without `[admission]` or
    /// without a healthy worker). With no request in flight, `reserved` is 0 and the room is
    /// whole: what an operator checks to see that no reservation was lost.
    pub(crate) fn figures(&self) -> Vec<(String, usize, usize, Option<usize>)> {
        let mut figures: Vec<(String, usize, usize)> = self
            .queues
            .lock()
            .iter()
            .map(|(model, queue)| (model.clone(), queue.waiters.len(), queue.reserved))
            .collect();
        figures.sort();
        figures
            .into_iter()
            .map(|(model, waiting, reserved)| {
                let room = self.config.as_ref().and_then(|config| self.room(config, &model));
                (model, waiting, reserved, room)
            })
            .collect()
    }

    fn waiting(&self) -> bool {
        self.queues.lock().values().any(|queue| !queue.waiters.is_empty())
    }

    /// Admits what the room there is now takes, in the batcher's order. The batcher is asked
    /// on a blocking thread, with the queue unlocked (a slow one holds up neither the executor
    /// nor requests joining the queue); what it chose is then taken by id.
    async fn pass(self: &Arc<Self>) {
        let Some(config) = &self.config else { return };
        let models: Vec<String> = self
            .queues
            .lock()
            .iter()
            .filter(|(_, queue)| !queue.waiters.is_empty())
            .map(|(model, _)| model.clone())
            .collect();
        for model in models {
            // With no healthy worker left, the waiting requests go on to routing's answer.
            let room = self.room(config, &model).unwrap_or(usize::MAX);
            let snapshot = {
                let mut queues = self.queues.lock();
                let Some(queue) = queues.get_mut(&model) else { continue };
                let before = queue.waiters.len();
                queue.waiters.retain(|waiter| !waiter.wake.is_closed());
                for _ in queue.waiters.len()..before {
                    self.count("abandoned");
                }
                let free = room.saturating_sub(queue.reserved).min(queue.waiters.len());
                (free > 0).then(|| snapshot(&queue.waiters, free))
            };
            let chosen = match snapshot {
                Some((table, tenancy, budget)) => {
                    let batchers = self.batchers.clone();
                    tokio::task::spawn_blocking(move || {
                        let (batches, _) = batchers.form_batches_for(&table, &tenancy, &budget);
                        let mut chosen: Vec<u32> =
                            batches.into_iter().next().map(|batch| batch.items).unwrap_or_default();
                        // The batcher orders; how many leave is the host's. A batch short of the
                        // room is topped up first come, first served.
                        let room = budget.max_items as usize;
                        if chosen.len() < room {
                            let rest = fallback(&table, &budget).into_iter().flat_map(|batch| batch.items);
                            let rest: Vec<u32> = rest.filter(|i| !chosen.contains(i)).collect();
                            chosen.extend(rest.into_iter().take(room - chosen.len()));
                        }
                        chosen
                            .iter()
                            .filter_map(|&i| table.ids.get(i as usize).copied())
                            .collect::<Vec<u64>>()
                    })
                    .await
                    .unwrap_or_default()
                }
                None => Vec::new(),
            };
            // Reservations whose waiter had gone: given back once the queue is unlocked (a
            // reservation's drop takes the lock).
            let mut refused = Vec::new();
            let mut queues = self.queues.lock();
            let Some(queue) = queues.get_mut(&model) else { continue };
            for id in chosen {
                let Some(position) = queue.waiters.iter().position(|waiter| waiter.id == id) else {
                    continue;
                };
                let waiter = queue.waiters.remove(position);
                queue.reserved += 1;
                let reservation = Reservation {
                    held: Some((self.clone(), model.clone())),
                };
                if let Err(reservation) = waiter.wake.send(reservation) {
                    self.count("abandoned");
                    refused.push(reservation);
                }
            }
            self.metrics
                .depth
                .get_or_create(&vec![("model", model.clone())])
                .set(queue.waiters.len() as i64);
            drop(queues);
            drop(refused);
        }
    }
}

/// The batcher's view of `waiters` (the queue's order), and a budget of `free` requests.
fn snapshot(waiters: &[Waiter], free: usize) -> (PendingTable, Tenancy, Budget) {
    let now = Instant::now();
    let table = PendingTable {
        ids: waiters.iter().map(|w| w.id).collect(),
        tokens: waiters.iter().map(|w| w.tokens).collect(),
        waited_ms: waiters
            .iter()
            .map(|w| now.saturating_duration_since(w.since).as_secs_f32() * 1000.0)
            .collect(),
        priority: waiters.iter().map(|w| w.priority).collect(),
        kinds: vec![0; waiters.len()],
        ready: vec![false; waiters.len()],
    };
    let tenancy = Tenancy {
        tenants: waiters.iter().map(|w| w.tenant_number).collect(),
        weights: waiters.iter().map(|w| w.weight).collect(),
    };
    let budget = Budget {
        token_budgets: vec![u32::MAX],
        max_items: u32::try_from(free).unwrap_or(u32::MAX),
        max_batches: 1,
    };
    (table, tenancy, budget)
}

#[cfg(test)]
mod tests {
    use std::pin::pin;

    use futures_util::poll;
    use sha2::{Digest, Sha256};

    use super::*;
    use crate::config::{ApiKeyConfig, Config, Role, WorkerConfig};
    use crate::metrics::Metrics;
    use crate::policy::runtime::{PolicyRuntime, RuntimeConfig};
    use crate::policy::switch::SwitchConfig;
    use crate::tenants::Tenants;
    use crate::workers::InFlight;

    /// A queue in front of one worker for each of `models`, each taking `max_requests` at once.
    fn admission(models: &[&str], max_requests: u32, config: impl FnOnce(&mut AdmissionConfig)) -> Arc<Admission> {
        let workers: Vec<WorkerConfig> = models
            .iter()
            .enumerate()
            .map(|(i, model)| WorkerConfig {
                name: Some(format!("w{i}")),
                url: format!("http://127.0.0.1:{}", 9000 + i),
                model: (*model).into(),
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
            })
            .collect();
        let pool = Arc::new(WorkerPool::new(&workers, Arc::new(Metrics::new())).expect("valid urls"));
        let kv = Arc::new(KvState::new(&Config::default()).expect("kv"));
        let runtime = Arc::new(PolicyRuntime::new(RuntimeConfig::default()).expect("engine"));
        let fcfs = crate::built_ins::find(crate::built_ins::World::Batcher, "fcfs").expect("built in");
        let batcher = runtime.load_batcher("fcfs", fcfs, toml::Table::new()).expect("loads");
        let batchers = Arc::new(BatcherSwitch::new(batcher, SwitchConfig::default()));
        let mut admission_config: AdmissionConfig =
            toml::from_str(&format!("max_requests = {max_requests}\nmax_wait_ms = 2000")).expect("config");
        config(&mut admission_config);
        Arc::new(Admission::new(
            Some(admission_config),
            pool,
            kv,
            batchers,
            AdmissionMetrics::default(),
        ))
    }

    fn ticket() -> Ticket<'static> {
        Ticket {
            grant: None,
            tokens: 10,
        }
    }

    fn reserved(admission: &Admission, model: &str) -> usize {
        admission.queues.lock().get(model).map_or(0, |queue| queue.reserved)
    }

    /// Holds every worker of the pool full (one request each).
    fn fill(admission: &Admission) -> Vec<InFlight> {
        admission
            .pool
            .workers()
            .iter()
            .map(|w| InFlight::new(w.clone()))
            .collect()
    }

    #[tokio::test]
    async fn a_request_dropped_after_its_wake_gives_its_room_back() {
        let admission = admission(&["m"], 1, |_| {});
        let busy = fill(&admission);
        // Boxed, so that dropping it drops the future itself.
        let mut entering = Box::pin(admission.enter("m", ticket()));
        assert!(poll!(entering.as_mut()).is_pending(), "queued behind the full worker");
        drop(busy);
        admission.pass().await;
        // The client left after the pass woke it, before its request was polled again.
        drop(entering);
        assert_eq!(reserved(&admission, "m"), 0, "the room taken for it came back");
        let next = tokio::time::timeout(Duration::from_secs(1), admission.enter("m", ticket())).await;
        assert!(matches!(next, Ok(Ok(_))), "the next request goes straight through");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn thousands_of_clients_leaving_as_room_frees_leave_the_room_whole() {
        let admission = admission(&["m"], 1, |_| {});
        let passes = admission.spawn().expect("configured");
        let waiting = |admission: &Admission| admission.queues.lock().get("m").map_or(0, |q| q.waiters.len());
        for round in 0..500u64 {
            let busy = fill(&admission);
            let clients: Vec<_> = (0..8)
                .map(|_| {
                    let admission = admission.clone();
                    tokio::spawn(async move {
                        if let Ok(reservation) = admission.enter("m", ticket()).await {
                            tokio::task::yield_now().await;
                            drop(reservation);
                        }
                    })
                })
                .collect();
            while waiting(&admission) < 8 {
                tokio::task::yield_now().await;
            }
            // Room frees (a pass runs on the other thread) just as every client goes away.
            drop(busy);
            for _ in 0..round % 4 {
                std::hint::spin_loop();
            }
            for client in &clients {
                client.abort();
            }
            for client in clients {
                let _ = client.await;
            }
        }
        let emptied = tokio::time::timeout(Duration::from_secs(5), async {
            while admission.waiting() || reserved(&admission, "m") != 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        passes.abort();
        assert!(
            emptied.is_ok(),
            "{} reservations never came back",
            reserved(&admission, "m")
        );
        assert_eq!(
            admission.room(admission.config.as_ref().expect("configured"), "m"),
            Some(1)
        );
    }

    #[tokio::test]
    async fn a_tenants_share_of_the_queue_counts_every_model() {
        let key = |text: &str| ApiKeyConfig {
            key_sha256: Sha256::digest(text.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            tenant: "acme".into(),
            models: Vec::new(),
            priority: 0,
            requests_per_minute: None,
            tokens_per_minute: None,
            monthly_tokens: None,
            weight: None,
        };
        let tenants = Tenants::new(&Config {
            api_keys: vec![key("sk-acme")],
            ..Config::default()
        })
        .expect("valid keys");
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, "Bearer sk-acme".parse().expect("header"));
        let grant = tenants.authenticate(&headers).expect("known").expect("a grant");
        let admission = admission(&["m1", "m2"], 1, |config| config.max_queue_per_tenant = 2);
        let _busy = fill(&admission);
        let enter = |model| {
            admission.enter(
                model,
                Ticket {
                    grant: Some(&grant),
                    tokens: 10,
                },
            )
        };
        let mut first = pin!(enter("m1"));
        let mut second = pin!(enter("m1"));
        assert!(poll!(first.as_mut()).is_pending());
        assert!(poll!(second.as_mut()).is_pending());
        match enter("m2").await {
            Err(err) => assert_eq!(err.status, StatusCode::TOO_MANY_REQUESTS, "{err:?}"),
            Ok(_) => panic!("a third request of the tenant was admitted"),
        }
    }
}
