//! The planner: sizes worker pools from live load and latency targets, by asking a `planner`
//! Wasm policy once per adjustment interval and handing its answer to a connector.
//!
//! Every `metric_interval_ms` the loop samples each pool's load into the [`window::Window`],
//! which the request path also feeds (requests as they are routed, answers as they end).
//! Every `adjustment_interval_s` — on the one gateway replica that holds the fleet's planning
//! lease, when there is a `[fleet]` — it closes the interval into each pool's
//! [`IntervalStats`], keeps the last [`HISTORY`] of them, and calls [`PlannerSwitch::plan`]
//! with the pools (off the async executor). Decisions the host accepts change the pools' desired
//! sizes, which the [`connector::Connector`] reconciles every metric interval (`no_operation`:
//! they are logged and exported only). A planner that fails holds every pool where it is.
//! Every decision, its reason and the observations behind it are logged and kept for
//! `GET /admin/planner`; metrics carry the desired and ready counts and the actions.
//!
//! A pool's workers are the healthy workers of its model whose role is the pool's
//! ([`window::pool_role_of`]: `llm` workers make aggregated pools, `prefill` and `decode`
//! workers pools of their own role, encoders encoder pools) and that its connector manages.
//! Its figures come from those workers and the requests they served, so a prefill pool and a
//! decode pool of one model each see their own:
//!
//! - KV usage: blocks held by the active requests at the pool's workers (the gateway's
//!   active-sequence tracker, or the engine's own report where it counts more, as routing
//!   reads them) over their capacity. A decode worker holds a request's prompt blocks from
//!   the moment it is routed there until its answer ends; a prefill worker holds them while it
//!   computes the prompt.
//! - Prefill queue: prompt tokens routed to the pool's workers and not yet computed there
//!   (uncached tokens). For a prefill pool, the prompts queued at or being computed by its
//!   workers, until each answers; for aggregated and decode pools, the prompts whose first
//!   token has not come back from them (at a decode worker, also those a prefill worker is
//!   still computing for it).
//! - Request rate and ISL: requests routed to the pool — to its workers as the answering
//!   worker (aggregated, decode), or with the prompt sent to one of its workers first (prefill).
//!   Requests that found no worker at all count for the model's answering pools.
//! - OSL, TTFT and ITL: answers that ended, for the pool of the worker that answered; a
//!   prefill pool takes the TTFT (and OSL) of the answers whose prompt its workers computed,
//!   and has no ITL.

pub mod connector;
pub mod kubernetes;
pub mod window;

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::{Value, json};

use crate::config::{PlannerConfig, PoolConfig, profiled_rate};
use crate::kv::KvState;
use crate::policy::planning::{IntervalStats, PlannedBy, PlannerSwitch, Pool, PoolRole, ScaleDecision};
use crate::workers::WorkerPool;
use connector::{Connector, LogOnly, ProcessConnector};
use window::{Window, pool_role_of};

/// Intervals of history each pool carries into `plan`.
pub const HISTORY: usize = 8;

/// Plans kept for `GET /admin/planner`.
const KEPT_PLANS: usize = 32;

/// KV blocks assumed for a worker that reports no capacity.
const DEFAULT_CAPACITY_BLOCKS: u64 = 16_384;

type Labels = Vec<(&'static str, String)>;

/// One pool's live state.
#[derive(Debug)]
struct PoolState {
    config: PoolConfig,
    role: PoolRole,
    desired: u32,
    /// Whether `desired` was taken from the connector's view of the pool (see
    /// [`Connector::current_size`]).
    adopted: bool,
    intervals_since_scale_up: u32,
    recent: VecDeque<IntervalStats>,
}

/// One plan, as `GET /admin/planner` shows it.
#[derive(Debug, Clone, serde::Serialize)]
struct PlanRecord {
    at_unix_ms: u64,
    by: String,
    acted: bool,
    decisions: Vec<Value>,
    observations: Vec<Value>,
}

/// The planner's metric families (registered before the planner exists, as every family is).
#[derive(Debug, Clone, Default)]
pub struct PlannerMetrics {
    desired: Family<Labels, Gauge>,
    ready: Family<Labels, Gauge>,
    actions: Family<Labels, Counter>,
    leader: Gauge,
}

/// Decides who plans among the fleet's replicas.
pub trait Lease: Send + Sync + std::fmt::Debug {
    /// Whether this replica holds the planning lease now (taking or renewing it).
    fn hold(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + '_>>;
}

/// A gateway that is not part of a fleet always plans.
#[derive(Debug)]
pub struct Alone;

impl Lease for Alone {
    fn hold(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + '_>> {
        Box::pin(async { true })
    }
}

/// A gateway's planner.
#[derive(Debug)]
pub struct Planner {
    config: PlannerConfig,
    switch: Arc<PlannerSwitch>,
    window: Arc<Window>,
    pools: Mutex<Vec<PoolState>>,
    workers: Arc<WorkerPool>,
    kv: Arc<KvState>,
    connector: Box<dyn Connector>,
    lease: Box<dyn Lease>,
    plans: Mutex<VecDeque<PlanRecord>>,
    metrics: PlannerMetrics,
    /// Whether this replica holds the planning lease (always, outside a fleet): only the
    /// holder plans and acts on its connector.
    leader: std::sync::atomic::AtomicBool,
    /// The model defaults' latency targets, by model.
    targets: std::collections::HashMap<String, (f32, f32)>,
}

fn pool_role(role: &str) -> PoolRole {
    match role {
        "prefill" => PoolRole::Prefill,
        "decode" => PoolRole::Decode,
        "encoder" => PoolRole::Encoder,
        _ => PoolRole::Aggregated,
    }
}

fn role_name(role: PoolRole) -> &'static str {
    match role {
        PoolRole::Aggregated => "aggregated",
        PoolRole::Prefill => "prefill",
        PoolRole::Decode => "decode",
        PoolRole::Encoder => "encoder",
    }
}

/// An interval in which nothing was seen.
fn empty_stats() -> IntervalStats {
    IntervalStats {
        request_rate: 0.0,
        mean_isl: 0.0,
        mean_osl: 0.0,
        ttft_p50_ms: 0.0,
        ttft_p90_ms: 0.0,
        itl_p50_ms: 0.0,
        itl_p90_ms: 0.0,
        kv_usage: 0.0,
        prefill_queue_tokens: 0.0,
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl PlannerMetrics {
    /// Registers the planner's families and `switch`'s.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry, switch: &PlannerSwitch) {
        switch.register_metrics(registry);
        registry.register(
            "planner_desired_workers",
            "Workers the planner wants per pool (model, role)",
            self.desired.clone(),
        );
        registry.register(
            "planner_ready_workers",
            "Workers in routing per planned pool (model, role)",
            self.ready.clone(),
        );
        registry.register(
            "planner_actions",
            "Planner decisions per pool, direction (up, down) and reason; acted or not (no_operation)",
            self.actions.clone(),
        );
        registry.register(
            "planner_leader",
            "1 while this replica holds the planning lease",
            self.leader.clone(),
        );
    }
}

impl Planner {
    /// A planner for `config` with `switch` as its policy, observing into `window` and
    /// counting into `metrics`; `targets` are the models' default latency targets (TTFT, ITL;
    /// 0: none).
    #[allow(clippy::too_many_arguments, reason = "the parts of a planner, each kept")]
    pub fn new(
        config: PlannerConfig,
        switch: Arc<PlannerSwitch>,
        window: Arc<Window>,
        metrics: PlannerMetrics,
        workers: Arc<WorkerPool>,
        kv: Arc<KvState>,
        lease: Box<dyn Lease>,
        targets: std::collections::HashMap<String, (f32, f32)>,
    ) -> Planner {
        let connector: Box<dyn Connector> = match config.connector.as_str() {
            _ if config.no_operation => Box::new(LogOnly),
            "process" => Box::new(ProcessConnector::default()),
            "kubernetes" => Box::new(kubernetes::KubernetesConnector::new(kubernetes::KubernetesApi {
                base: config.kubernetes_api().unwrap_or_default(),
                credentials: config.kubernetes_credentials.clone(),
            })),
            _ => Box::new(LogOnly),
        };
        let pools = config
            .pools
            .iter()
            .map(|pool| PoolState {
                config: pool.clone(),
                role: pool_role(&pool.role),
                desired: pool.min_workers,
                adopted: false,
                intervals_since_scale_up: u32::MAX,
                recent: VecDeque::new(),
            })
            .collect();
        Planner {
            config,
            switch,
            window,
            pools: Mutex::new(pools),
            workers,
            kv,
            connector,
            lease,
            plans: Mutex::new(VecDeque::new()),
            metrics,
            leader: std::sync::atomic::AtomicBool::new(false),
            targets,
        }
    }

    /// The live planner policy.
    pub fn switch(&self) -> &Arc<PlannerSwitch> {
        &self.switch
    }

    /// The settings a pushed planner is loaded with (`[planner] policy_config`).
    pub fn policy_config(&self) -> &toml::Table {
        &self.config.policy_config
    }

    fn labels(pool: &PoolState) -> Labels {
        vec![
            ("model", pool.config.model.clone()),
            ("role", role_name(pool.role).to_string()),
        ]
    }

    /// The names of pool `index`'s workers in routing: its model's, of its role (see the
    /// module docs), that its connector manages.
    fn registered(&self, index: usize, pool: &PoolState) -> HashSet<String> {
        self.workers
            .workers()
            .iter()
            .filter(|w| w.model == pool.config.model && w.is_healthy())
            .filter(|w| pool_role_of(w.role) == pool.role)
            .filter(|w| self.connector.manages(index, &pool.config, &w.name))
            .map(|w| w.name.clone())
            .collect()
    }

    /// Whether decisions start and stop workers (not `no_operation`, not connector `none`).
    fn acts(&self) -> bool {
        !self.config.no_operation && self.config.connector != "none"
    }

    /// Whether this replica holds the planning lease now.
    fn leads(&self) -> bool {
        self.leader.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One metric tick: samples each pool's load and reconciles its size.
    pub fn tick(&self) {
        let mut pools = self.pools.lock();
        let acts = self.acts();
        for (index, pool) in pools.iter_mut().enumerate() {
            let registered = self.registered(index, pool);
            if !acts {
                // Nothing acts on decisions: the size to plan from is what runs.
                pool.desired = (registered.len() as u32).clamp(pool.config.min_workers, pool.config.max_workers);
            } else if !pool.adopted
                && let Some(size) = self.connector.current_size(index)
            {
                pool.desired = size.clamp(pool.config.min_workers, pool.config.max_workers);
                pool.adopted = true;
                tracing::info!(model = %pool.config.model, size, desired = pool.desired, "planner adopted the pool's size");
            }
            let members: Vec<_> = self
                .workers
                .workers()
                .iter()
                .filter(|w| registered.contains(&w.name))
                .cloned()
                .collect();
            let loads = self.kv.loads(members.iter().map(|w| w.kv_id));
            let (mut used, mut capacity, mut queue) = (0u64, 0u64, 0u64);
            for (worker, load) in members.iter().zip(&loads) {
                // As the routing table reads a worker's load: an engine that reports its own
                // counts what other gateways and clients sent it too, and the larger stands.
                let engine = worker.engine_load();
                let blocks = engine
                    .and_then(|engine| engine.capacity_blocks)
                    .filter(|blocks| *blocks > 0)
                    .unwrap_or(worker.capacity_blocks);
                let blocks = if blocks > 0 { blocks } else { DEFAULT_CAPACITY_BLOCKS };
                let engine_used = engine.and_then(|engine| engine.used_blocks(blocks)).unwrap_or(0);
                used += u64::from(load.active_blocks).max(engine_used);
                capacity += blocks;
                queue += load.prefill_tokens;
            }
            let usage = if capacity > 0 {
                used as f64 / capacity as f64
            } else {
                0.0
            };
            self.window.sample(index, usage, queue as f64);
            self.metrics
                .ready
                .get_or_create(&Planner::labels(pool))
                .set(registered.len() as i64);
            if acts
                && self.leads()
                && let Err(err) = self.connector.reconcile(index, &pool.config, pool.desired, &registered)
            {
                tracing::warn!(model = %pool.config.model, error = %err, "planner connector failed");
            }
        }
    }

    /// The pools as `plan` sees them, closing the interval.
    fn observe(&self) -> Vec<Pool> {
        let mut pools = self.pools.lock();
        let keys: Vec<(String, PoolRole)> = pools.iter().map(|p| (p.config.model.clone(), p.role)).collect();
        let refs: Vec<(&str, PoolRole)> = keys.iter().map(|(model, role)| (model.as_str(), *role)).collect();
        let closed = self.window.close(&refs);
        let interval_s = self.config.adjustment_interval_s;
        pools
            .iter_mut()
            .zip(closed)
            .enumerate()
            .map(|(index, (pool, stats))| {
                pool.recent.push_back(stats);
                while pool.recent.len() > HISTORY {
                    pool.recent.pop_front();
                }
                let registered = self.registered(index, pool);
                let under_way = self.connector.under_way(index, &registered);
                let (ttft, itl) = self.targets.get(&pool.config.model).copied().unwrap_or((0.0, 0.0));
                let last = pool.recent.back().copied().unwrap_or_else(empty_stats);
                Pool {
                    model: pool.config.model.clone(),
                    role: pool.role,
                    ready: registered.len() as u32,
                    starting: under_way.starting,
                    draining: under_way.draining,
                    desired: pool.desired,
                    min_workers: pool.config.min_workers,
                    max_workers: pool.config.max_workers,
                    gpus_per_worker: pool.config.gpus_per_worker,
                    ttft_target_ms: ttft,
                    itl_target_ms: itl,
                    prefill_capacity_tokens: (pool.config.prefill_tokens_per_s * interval_s) as f32,
                    profiled_rate: profiled_rate(
                        &pool.config.profile,
                        f64::from(last.mean_isl),
                        f64::from(last.mean_osl),
                    ) as f32,
                    intervals_since_scale_up: pool.intervals_since_scale_up,
                    recent: pool.recent.iter().copied().collect(),
                }
            })
            .collect()
    }

    /// Applies accepted `decisions` (see the module docs) and records the plan.
    fn apply(&self, observed: &[Pool], decisions: &[ScaleDecision], by: &PlannedBy) {
        let acted = self.acts();
        let mut pools = self.pools.lock();
        for pool in pools.iter_mut() {
            pool.intervals_since_scale_up = pool.intervals_since_scale_up.saturating_add(1);
        }
        let mut shown = Vec::new();
        for decision in decisions {
            let Some(pool) = pools.get_mut(decision.pool as usize) else {
                continue;
            };
            if decision.replicas == pool.desired {
                continue;
            }
            let direction = if decision.replicas > pool.desired { "up" } else { "down" };
            tracing::info!(
                model = %pool.config.model,
                role = role_name(pool.role),
                from = pool.desired,
                to = decision.replicas,
                reason = %decision.reason,
                acted,
                planner = %by.label(),
                "planner decision"
            );
            let mut labels = Planner::labels(pool);
            labels.push(("direction", direction.to_string()));
            labels.push(("reason", decision.reason.clone()));
            labels.push(("acted", acted.to_string()));
            self.metrics.actions.get_or_create(&labels).inc();
            shown.push(json!({
                "model": pool.config.model,
                "role": role_name(pool.role),
                "from": pool.desired,
                "to": decision.replicas,
                "reason": decision.reason,
            }));
            if acted {
                if decision.replicas > pool.desired {
                    pool.intervals_since_scale_up = 0;
                }
                pool.desired = decision.replicas;
            }
        }
        for pool in pools.iter() {
            self.metrics
                .desired
                .get_or_create(&Planner::labels(pool))
                .set(i64::from(pool.desired));
        }
        let observations = observed
            .iter()
            .map(|pool| {
                let last = pool.recent.last().copied().unwrap_or_else(empty_stats);
                json!({
                    "model": pool.model,
                    "role": role_name(pool.role),
                    "ready": pool.ready,
                    "starting": pool.starting,
                    "draining": pool.draining,
                    "desired": pool.desired,
                    "request_rate": last.request_rate,
                    "mean_isl": last.mean_isl,
                    "mean_osl": last.mean_osl,
                    "ttft_p90_ms": last.ttft_p90_ms,
                    "itl_p90_ms": last.itl_p90_ms,
                    "kv_usage": last.kv_usage,
                    "prefill_queue_tokens": last.prefill_queue_tokens,
                    "profiled_rate": pool.profiled_rate,
                })
            })
            .collect();
        let mut plans = self.plans.lock();
        plans.push_back(PlanRecord {
            at_unix_ms: unix_ms(),
            by: by.label(),
            acted,
            decisions: shown,
            observations,
        });
        while plans.len() > KEPT_PLANS {
            plans.pop_front();
        }
    }

    /// One adjustment: observe, ask the policy, apply. Answers what was decided.
    pub async fn adjust(self: &Arc<Self>) -> (Vec<ScaleDecision>, PlannedBy) {
        let observed = self.observe();
        let planner = self.clone();
        let pools = observed.clone();
        let budget = self.config.max_gpu_budget;
        let planned = tokio::task::spawn_blocking(move || planner.switch.plan(&pools, budget)).await;
        let (decisions, by) = planned.unwrap_or_else(|_| (Vec::new(), PlannedBy::Fallback("panic")));
        self.apply(&observed, &decisions, &by);
        (decisions, by)
    }

    /// Runs the loop until the gateway stops.
    pub fn spawn(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let planner = self.clone();
        tokio::spawn(async move {
            let metric = Duration::from_millis(planner.config.metric_interval_ms);
            let adjustment = Duration::from_secs_f64(planner.config.adjustment_interval_s);
            // The lease is renewed three times per lease period, whatever the adjustment
            // interval: a holder that renewed only when it plans would let the lease lapse
            // between plans, and another replica would plan in the same interval.
            let renewal = Duration::from_millis((planner.config.lease_ms / 3).max(1));
            let mut ticks = tokio::time::interval(metric);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut next_adjustment = tokio::time::Instant::now() + adjustment;
            let mut next_renewal = tokio::time::Instant::now();
            loop {
                ticks.tick().await;
                if tokio::time::Instant::now() >= next_renewal {
                    next_renewal = tokio::time::Instant::now() + renewal;
                    let leader = planner.lease.hold().await;
                    planner.leader.store(leader, std::sync::atomic::Ordering::Relaxed);
                    planner.metrics.leader.set(i64::from(leader));
                }
                planner.tick();
                if tokio::time::Instant::now() < next_adjustment {
                    continue;
                }
                next_adjustment += adjustment;
                if planner.leader.load(std::sync::atomic::Ordering::Relaxed) {
                    planner.adjust().await;
                } else {
                    // Another replica plans; keep the window from growing.
                    planner.observe();
                }
            }
        })
    }

    /// What `GET /admin/planner` answers.
    pub fn status(&self) -> Value {
        let pools = self.pools.lock();
        let pools: Vec<Value> = pools
            .iter()
            .enumerate()
            .map(|(index, pool)| {
                let registered = self.registered(index, pool);
                let under_way = self.connector.under_way(index, &registered);
                let mut ready: Vec<&String> = registered.iter().collect();
                ready.sort();
                json!({
                    "model": pool.config.model,
                    "role": role_name(pool.role),
                    "desired": pool.desired,
                    "ready": ready,
                    "starting": under_way.starting,
                    "draining": under_way.draining,
                    "min_workers": pool.config.min_workers,
                    "max_workers": pool.config.max_workers,
                })
            })
            .collect();
        let active = self.switch.active();
        json!({
            "policy": format!("{}#{}", active.label(), active.generation),
            "connector": self.config.connector,
            "no_operation": self.config.no_operation,
            "adjustment_interval_s": self.config.adjustment_interval_s,
            "max_gpu_budget": self.config.max_gpu_budget,
            "pools": pools,
            "plans": self.plans.lock().iter().collect::<Vec<_>>(),
        })
    }
}
