//! The live router policy: publishing versions, calling the active one, failing safe.
//!
//! A [`PolicySwitch`] holds the active version behind an `ArcSwap` and the last few versions for
//! rollback. Each runtime thread keeps its own instance of the active version (a wasmtime
//! `Store` is not `Sync`) and notices a new version by comparing generation numbers, one atomic
//! load per call; it re-instantiates lazily on its next request. A call that traps, runs past
//! its deadline, refuses or answers out of range is served by the native least-load fallback;
//! the thread's instance is dropped and re-created after a backoff, the failure is counted, and
//! after `max_failures` failures of one version the previous version is restored automatically.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::policy::PolicyError;
use crate::policy::runtime::{RouterInstance, RouterPolicy};
use crate::policy::table::{self, RequestInfo, WorkerTable};

/// One published version of a policy.
#[derive(Debug)]
pub struct Version {
    /// Increases with every publish; threads compare it to notice a swap.
    pub generation: u64,
    /// The compiled policy.
    pub policy: Arc<RouterPolicy>,
    failures: AtomicU32,
    /// Milliseconds since the switch's start before which no thread re-instantiates.
    retry_after_ms: AtomicU64,
}

impl Version {
    /// A label for metrics and logs: `name@sha256-prefix`.
    pub fn label(&self) -> String {
        format!(
            "{}@{}",
            self.policy.name,
            &self.policy.sha256[..12.min(self.policy.sha256.len())]
        )
    }

    /// Failures counted against this version.
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }
}

/// How a request was routed.
#[derive(Debug, Clone)]
pub enum Routed {
    /// By this policy version.
    Policy(Arc<Version>),
    /// By the native fallback, because of the named failure kind.
    Fallback(&'static str),
}

impl Routed {
    /// The generation of the version that decided, if a policy did.
    pub fn generation(&self) -> Option<u64> {
        match self {
            Routed::Policy(version) => Some(version.generation),
            Routed::Fallback(_) => None,
        }
    }

    /// `NAME@SHA#GENERATION` for a policy, `fallback:KIND` otherwise (a response header).
    pub fn label(&self) -> String {
        match self {
            Routed::Policy(version) => format!("{}#{}", version.label(), version.generation),
            Routed::Fallback(kind) => format!("fallback:{kind}"),
        }
    }
}

/// Settings of failure handling.
#[derive(Debug, Clone)]
pub struct SwitchConfig {
    /// Failures of one version after which the previous version is restored.
    pub max_failures: u32,
    /// Versions kept for rollback.
    pub keep_versions: usize,
    /// First re-instantiation backoff; doubles per failure up to one second.
    pub backoff: Duration,
}

impl Default for SwitchConfig {
    fn default() -> SwitchConfig {
        SwitchConfig {
            max_failures: 5,
            keep_versions: 4,
            backoff: Duration::from_millis(10),
        }
    }
}

/// The live router policy of a gateway.
#[derive(Debug)]
pub struct PolicySwitch {
    active: ArcSwap<Version>,
    previous: Mutex<VecDeque<Arc<Version>>>,
    next_generation: AtomicU64,
    config: SwitchConfig,
    started: Instant,
    decisions: Family<Vec<(&'static str, String)>, Counter>,
    failures: Family<Vec<(&'static str, String)>, Counter>,
    rollbacks: Counter,
}

thread_local! {
    /// This thread's instance of the active version: (switch address, generation, instance).
    static INSTANCE: RefCell<Option<(usize, u64, RouterInstance)>> = const { RefCell::new(None) };
}

impl PolicySwitch {
    /// A switch whose active version is `policy`.
    pub fn new(policy: RouterPolicy, config: SwitchConfig) -> PolicySwitch {
        let first = Arc::new(Version {
            generation: 1,
            policy: Arc::new(policy),
            failures: AtomicU32::new(0),
            retry_after_ms: AtomicU64::new(0),
        });
        PolicySwitch {
            active: ArcSwap::new(first),
            previous: Mutex::new(VecDeque::new()),
            next_generation: AtomicU64::new(2),
            config,
            started: Instant::now(),
            decisions: Family::default(),
            failures: Family::default(),
            rollbacks: Counter::default(),
        }
    }

    /// Registers the switch's metrics.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "policy_decisions",
            "Routing decisions, by policy version and outcome",
            self.decisions.clone(),
        );
        registry.register(
            "policy_failures",
            "Policy calls that failed, by version and kind",
            self.failures.clone(),
        );
        registry.register(
            "policy_rollbacks",
            "Automatic rollbacks to a previous policy version",
            self.rollbacks.clone(),
        );
    }

    /// The active version.
    pub fn active(&self) -> Arc<Version> {
        self.active.load_full()
    }

    /// The versions kept for rollback, oldest first.
    pub fn previous(&self) -> Vec<Arc<Version>> {
        self.previous
            .lock()
            .map(|versions| versions.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Makes `policy` the active version; the old one is kept for rollback. Requests already
    /// routed are unaffected; each thread switches on its next call.
    pub fn publish(&self, policy: Arc<RouterPolicy>) -> Arc<Version> {
        let version = Arc::new(Version {
            generation: self.next_generation.fetch_add(1, Ordering::Relaxed),
            policy,
            failures: AtomicU32::new(0),
            retry_after_ms: AtomicU64::new(0),
        });
        let old = self.active.swap(version.clone());
        if let Ok(mut previous) = self.previous.lock() {
            previous.push_back(old);
            while previous.len() > self.config.keep_versions {
                previous.pop_front();
            }
        }
        tracing::info!(version = %version.label(), generation = version.generation, "router policy published");
        version
    }

    /// Restores the most recent previous version. Returns it, or `None` if there is none.
    pub fn rollback(&self) -> Option<Arc<Version>> {
        let restored = self.previous.lock().ok()?.pop_back()?;
        restored.failures.store(0, Ordering::Relaxed);
        restored.retry_after_ms.store(0, Ordering::Relaxed);
        let failed = self.active.swap(restored.clone());
        tracing::warn!(from = %failed.label(), to = %restored.label(), "router policy rolled back");
        Some(restored)
    }

    /// Picks a worker index in `table` for `request`: from the active policy when it answers
    /// sanely, from the native least-load fallback otherwise. `None` only when the table holds
    /// no LLM worker.
    pub fn route(&self, request: &RequestInfo, table: &WorkerTable) -> (Option<u32>, Routed) {
        let version = self.active.load();
        let key = self as *const PolicySwitch as usize;
        let now_ms = self.started.elapsed().as_millis() as u64;
        let outcome = INSTANCE.with(|slot| {
            let mut slot = slot.borrow_mut();
            let current =
                matches!(&*slot, Some((owner, generation, _)) if *owner == key && *generation == version.generation);
            if !current {
                *slot = None;
                if now_ms < version.retry_after_ms.load(Ordering::Relaxed) {
                    return Err(None);
                }
                match version.policy.instantiate() {
                    Ok(instance) => *slot = Some((key, version.generation, instance)),
                    Err(err) => return Err(Some(err)),
                }
            }
            let Some((_, _, instance)) = slot.as_mut() else {
                return Err(None);
            };
            match instance.route(request, table) {
                Ok(index) => Ok(index),
                Err(err) => {
                    // A trapped instance cannot be entered again; drop it either way.
                    *slot = None;
                    Err(Some(err))
                }
            }
        });
        match outcome {
            Ok(index) => {
                self.decisions
                    .get_or_create(&vec![("version", version.label()), ("outcome", "policy".into())])
                    .inc();
                (Some(index), Routed::Policy(Arc::clone(&version)))
            }
            Err(failure) => {
                let kind = match &failure {
                    Some(err) => {
                        self.record_failure(&version, err, now_ms);
                        err.kind()
                    }
                    None => "backoff",
                };
                self.decisions
                    .get_or_create(&vec![("version", version.label()), ("outcome", "fallback".into())])
                    .inc();
                (table::least_load(table), Routed::Fallback(kind))
            }
        }
    }

    fn record_failure(&self, version: &Arc<Version>, err: &PolicyError, now_ms: u64) {
        self.failures
            .get_or_create(&vec![("version", version.label()), ("kind", err.kind().to_string())])
            .inc();
        let failures = version.failures.fetch_add(1, Ordering::Relaxed) + 1;
        let backoff = self
            .config
            .backoff
            .saturating_mul(1 << failures.min(7))
            .min(Duration::from_secs(1));
        version
            .retry_after_ms
            .store(now_ms + backoff.as_millis() as u64, Ordering::Relaxed);
        tracing::warn!(version = %version.label(), failures, error = %err, "policy failed; request served by the fallback");
        if failures == self.config.max_failures {
            let still_active = Arc::ptr_eq(&self.active.load_full(), version);
            if still_active && self.rollback().is_some() {
                self.rollbacks.inc();
            }
        }
    }
}
