//! Planners as Wasm policies: loading `planner` components, checking their answers, and the
//! live switch between versions with hold-the-size as the fallback.
//!
//! The planning loop ([`crate::planner`]) asks [`PlannerSwitch::plan`] once per adjustment
//! interval. The active version answers if it can; an answer that breaks the contract (a pool
//! index out of range or twice, a size outside the pool's `min-workers..=max-workers`, a fleet
//! past its GPU budget), a trap, a refusal or a call past the deadline is replaced by the
//! fallback — no decision, every pool holds its size — so a hostile planner can never start or
//! stop a worker. Failures count against the version and roll it back as routers' do
//! ([`crate::policy::versions`]). Calls are rare (one per interval), so one instance is kept.

use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::policy::PolicyError;
use crate::policy::bindings::PlannerWorld;
pub use crate::policy::bindings::planning::{IntervalStats, Pool, PoolRole, ScaleDecision};
use crate::policy::runtime::PolicyRuntime;
use crate::policy::versions::{Labels, SwitchConfig, Version, Versions};
use crate::policy::world::{Compiled, Instance};

/// Longest `reason` kept from a decision (metrics label, log line).
pub const MAX_REASON_BYTES: usize = 64;

/// A validated planner policy: compiled code ready to instantiate. Immutable and shared.
pub type PlannerPolicy = Compiled<PlannerWorld>;

/// One live instance of a planner policy.
pub type PlannerInstance = Instance<PlannerWorld>;

impl PolicyRuntime {
    /// Compiles (or loads from the cache), validates and self-tests a planner policy.
    ///
    /// # Errors
    ///
    /// Returns [`PolicyError`] if the bytes are not a component, import anything outside the
    /// host world and `planning`, do not export the `planner` world, fail `init`, or answer the
    /// self-test against the contract.
    pub fn load_planner(
        self: &Arc<Self>,
        name: &str,
        wasm: &[u8],
        policy_config: toml::Table,
    ) -> Result<PlannerPolicy, PolicyError> {
        let (pools, max_gpus) = synthetic_pools();
        Compiled::load(self, name, wasm, policy_config, |instance| {
            instance.plan(&pools, max_gpus).map(drop)
        })
    }
}

impl Instance<PlannerWorld> {
    /// Calls `plan` under the deadline and checks the answer against the contract.
    ///
    /// # Errors
    ///
    /// [`PolicyError::Trap`] (deadline, memory, a trap), [`PolicyError::Refused`] or
    /// [`PolicyError::InvalidAnswer`].
    pub fn plan(&mut self, pools: &[Pool], max_gpus: u32) -> Result<Vec<ScaleDecision>, PolicyError> {
        let (store, bindings) = self.armed();
        let decisions = bindings.call_plan(&mut *store, pools, max_gpus);
        store.data_mut().end_call();
        let mut decisions = decisions
            .map_err(PolicyError::trap)?
            .map_err(|err| PolicyError::Refused(err.message))?;
        validate(pools, max_gpus, &decisions).map_err(PolicyError::InvalidAnswer)?;
        for decision in &mut decisions {
            truncate_reason(&mut decision.reason);
        }
        Ok(decisions)
    }
}

/// Cuts `reason` to [`MAX_REASON_BYTES`] on a character boundary.
fn truncate_reason(reason: &mut String) {
    if reason.len() > MAX_REASON_BYTES {
        let mut end = MAX_REASON_BYTES;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
}

/// Checks `decisions` against the contract for `pools` (see the module docs): each names a
/// pool once, within its bounds, and the fleet's GPUs after them fit `max_gpus` (0: no budget)
/// unless they only shrink it.
///
/// # Errors
///
/// What is wrong, for the operator's log.
pub fn validate(pools: &[Pool], max_gpus: u32, decisions: &[ScaleDecision]) -> Result<(), String> {
    let mut seen = vec![false; pools.len()];
    let mut desired: Vec<u64> = pools.iter().map(|pool| u64::from(pool.desired)).collect();
    for decision in decisions {
        let index = decision.pool as usize;
        let pool = pools
            .get(index)
            .ok_or_else(|| format!("decision for pool {index} of {}", pools.len()))?;
        if std::mem::replace(&mut seen[index], true) {
            return Err(format!("two decisions for pool {index}"));
        }
        if decision.replicas < pool.min_workers || decision.replicas > pool.max_workers {
            return Err(format!(
                "{} workers for pool {index} ({} {:?}), outside {}..={}",
                decision.replicas, pool.model, pool.role, pool.min_workers, pool.max_workers
            ));
        }
        desired[index] = u64::from(decision.replicas);
    }
    if max_gpus > 0 {
        let gpus = |sizes: &mut dyn Iterator<Item = u64>| -> u64 {
            sizes
                .zip(pools)
                .map(|(size, pool)| size * u64::from(pool.gpus_per_worker))
                .sum()
        };
        let before = gpus(&mut pools.iter().map(|pool| u64::from(pool.desired)));
        let after = gpus(&mut desired.iter().copied());
        if after > u64::from(max_gpus) && after > before {
            return Err(format!(
                "the fleet would take {after} GPUs, over the budget of {max_gpus}"
            ));
        }
    }
    Ok(())
}

/// A fleet the self-test asks a planner about: an aggregated pool under rising load and a
/// prefill pool with a queue, with a few intervals of history.
fn synthetic_pools() -> (Vec<Pool>, u32) {
    let interval = |rate: f32, usage: f32, queue: f32| IntervalStats {
        request_rate: rate,
        mean_isl: 3000.0,
        mean_osl: 200.0,
        ttft_p50_ms: 300.0,
        ttft_p90_ms: 900.0,
        itl_p50_ms: 20.0,
        itl_p90_ms: 35.0,
        kv_usage: usage,
        prefill_queue_tokens: queue,
    };
    let pool = |role: PoolRole, recent: Vec<IntervalStats>| Pool {
        model: "self-test".into(),
        role,
        ready: 2,
        starting: 0,
        draining: 0,
        desired: 2,
        min_workers: 1,
        max_workers: 4,
        gpus_per_worker: 1,
        ttft_target_ms: 1000.0,
        itl_target_ms: 50.0,
        prefill_capacity_tokens: 100_000.0,
        profiled_rate: 4.0,
        intervals_since_scale_up: 5,
        recent,
    };
    (
        vec![
            pool(
                PoolRole::Aggregated,
                vec![interval(4.0, 0.6, 1000.0), interval(8.0, 0.95, 9000.0)],
            ),
            pool(PoolRole::Prefill, vec![interval(2.0, 0.1, 50_000.0)]),
        ],
        8,
    )
}

/// What decided a plan.
#[derive(Debug, Clone)]
pub enum PlannedBy {
    /// This planner version.
    Policy(Arc<Version<PlannerPolicy>>),
    /// The fallback (every pool holds its size), because of the named failure kind.
    Fallback(&'static str),
}

impl PlannedBy {
    /// `NAME@SHA#GENERATION` for a policy, `fallback:KIND` otherwise.
    pub fn label(&self) -> String {
        match self {
            PlannedBy::Policy(version) => format!("{}#{}", version.label(), version.generation),
            PlannedBy::Fallback(kind) => format!("fallback:{kind}"),
        }
    }
}

/// The live planner of a gateway.
#[derive(Debug)]
pub struct PlannerSwitch {
    versions: Versions<PlannerPolicy>,
    instance: Mutex<Option<(u64, PlannerInstance)>>,
    decisions: Family<Labels, Counter>,
}

impl PlannerSwitch {
    /// A switch whose active version is `policy`.
    pub fn new(policy: PlannerPolicy, config: SwitchConfig) -> PlannerSwitch {
        PlannerSwitch {
            versions: Versions::new("planner", policy, config),
            instance: Mutex::new(None),
            decisions: Family::default(),
        }
    }

    /// Registers the switch's metrics.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "planner_calls",
            "Planning calls, by planner version and outcome (policy, fallback)",
            self.decisions.clone(),
        );
        registry.register(
            "planner_failures",
            "Planner calls that failed, by version and kind",
            self.versions.failures.clone(),
        );
        registry.register(
            "planner_rollbacks",
            "Automatic rollbacks to a previous planner version",
            self.versions.rollbacks.clone(),
        );
    }

    /// The active version.
    pub fn active(&self) -> Arc<Version<PlannerPolicy>> {
        self.versions.active()
    }

    /// The versions kept for rollback, oldest first.
    pub fn previous(&self) -> Vec<Arc<Version<PlannerPolicy>>> {
        self.versions.previous()
    }

    /// Makes `policy` the active version; the next interval uses it.
    pub fn publish(&self, policy: Arc<PlannerPolicy>) -> Arc<Version<PlannerPolicy>> {
        self.versions.publish(policy)
    }

    /// Restores the most recent previous version, if there is one.
    pub fn rollback(&self) -> Option<Arc<Version<PlannerPolicy>>> {
        self.versions.rollback()
    }

    /// The active version's decisions for `pools`, or none (every pool holds) when it fails.
    pub fn plan(&self, pools: &[Pool], max_gpus: u32) -> (Vec<ScaleDecision>, PlannedBy) {
        let version = self.versions.active();
        let (decisions, by) = match self.call(&version, pools, max_gpus) {
            Ok(decisions) => (decisions, PlannedBy::Policy(version.clone())),
            Err(kind) => (Vec::new(), PlannedBy::Fallback(kind)),
        };
        version
            .decisions(&self.decisions, matches!(by, PlannedBy::Fallback(_)))
            .inc();
        (decisions, by)
    }

    fn call(
        &self,
        version: &Arc<Version<PlannerPolicy>>,
        pools: &[Pool],
        max_gpus: u32,
    ) -> Result<Vec<ScaleDecision>, &'static str> {
        let kept = self
            .instance
            .lock()
            .take()
            .filter(|(generation, _)| *generation == version.generation)
            .map(|(_, instance)| instance);
        let instance = match kept {
            Some(instance) => Ok(instance),
            None if !version.may_instantiate(self.versions.now_ms()) => return Err("backoff"),
            None => version.policy.instantiate(),
        };
        let result = instance.and_then(|mut instance| {
            let decisions = instance.plan(pools, max_gpus);
            // An instance that answered (even nonsense) can be entered again; a trapped one not.
            if !matches!(decisions, Err(PolicyError::Trap(_))) {
                *self.instance.lock() = Some((version.generation, instance));
            }
            decisions
        });
        result.map_err(|err| {
            tracing::warn!(planner = %version.label(), error = %err, "planner failed: every pool holds its size");
            if self.versions.record_failure(version, &err) {
                self.versions.roll_back_if_active(version);
            }
            err.kind()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(pool: u32, replicas: u32) -> ScaleDecision {
        ScaleDecision {
            pool,
            replicas,
            reason: "test".into(),
        }
    }

    #[test]
    fn answers_outside_the_contract_are_refused() {
        let (pools, budget) = synthetic_pools();
        assert!(validate(&pools, budget, &[decision(0, 3), decision(1, 1)]).is_ok());
        assert!(validate(&pools, budget, &[]).is_ok(), "holding everything is an answer");
        let out_of_range = validate(&pools, budget, &[decision(2, 1)]).unwrap_err();
        assert!(out_of_range.contains("pool 2 of 2"), "{out_of_range}");
        assert!(validate(&pools, budget, &[decision(0, 3), decision(0, 2)]).is_err());
        assert!(validate(&pools, budget, &[decision(0, 5)]).is_err(), "over max-workers");
        assert!(
            validate(&pools, budget, &[decision(0, 0)]).is_err(),
            "under min-workers"
        );
        assert!(validate(&pools, budget, &[decision(0, u32::MAX)]).is_err());
        // 4 + 4 GPUs fit 8; over a budget of 5, a plan may shrink the fleet but not grow it.
        assert!(validate(&pools, 8, &[decision(0, 4), decision(1, 4)]).is_ok());
        assert!(validate(&pools, 5, &[decision(0, 4)]).is_err());
        assert!(validate(&pools, 3, &[decision(0, 1)]).is_ok());
    }

    #[test]
    fn long_reasons_are_cut_on_a_character_boundary() {
        let mut reason = "é".repeat(40);
        truncate_reason(&mut reason);
        assert_eq!(reason.len(), MAX_REASON_BYTES);
        let mut short = String::from("kv usage");
        truncate_reason(&mut short);
        assert_eq!(short, "kv usage");
    }
}
