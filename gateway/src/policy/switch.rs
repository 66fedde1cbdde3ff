//! The live router policy: publishing versions, calling the active one, failing safe.
//!
//! A [`PolicySwitch`] holds the active version behind an `ArcSwap` and the last few versions for
//! rollback. Each runtime thread keeps its own instance of the active version (a wasmtime
//! `Store` is not `Sync`) and notices a new version by comparing generation numbers, one atomic
//! load per call; it re-instantiates lazily on its next request. A call that traps, runs past
//! its deadline, refuses or answers out of range is served by the native least-load fallback;
//! the thread's instance is dropped and re-created after a backoff, the failure is counted, and
//! after `max_failures` failures of one version the previous version is restored automatically.
//!
//! A version that stops deciding (replaced, rolled back, a rollout ended) has its instances
//! dropped at once, idle threads' included: each thread's instance sits in a slot the switch
//! can also reach, and [`PolicySwitch`] empties the slots of retired versions, so a policy
//! that leaked up to its memory cap gives that memory back without waiting for traffic.

use std::borrow::Borrow;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::policy::runtime::{Pick, RouterInstance, RouterPolicy};
use crate::policy::table::{self, Columns, RequestInfo, WorkerTable};
pub use crate::policy::versions::SwitchConfig;
use crate::policy::versions::{Labels, Versions};

/// One published version of a router policy.
pub type Version = crate::policy::versions::Version<RouterPolicy>;

impl crate::policy::versions::Named for RouterPolicy {
    fn name(&self) -> &str {
        &self.name
    }

    fn sha256(&self) -> &str {
        &self.sha256
    }
}

/// Where a request falls in a split rollout's 100 buckets: by its affinity key, so the same
/// key always lands on the same side, or, without one (affinity 0), by a hash of its id.
fn split_draw(request: &RequestInfo) -> u64 {
    match request.affinity {
        0 => xxhash_rust::xxh3::xxh3_64(&request.request_id.to_le_bytes()),
        key => key,
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

    /// [`Routed::label`] as a header value (`None` where a header cannot carry it); a policy
    /// version's is made once and shared.
    pub fn header_value(&self) -> Option<http::HeaderValue> {
        match self {
            Routed::Policy(version) => version.header_value(),
            Routed::Fallback(_) => http::HeaderValue::from_str(&self.label()).ok(),
        }
    }
}

/// The live router policy of a gateway.
#[derive(Debug)]
pub struct PolicySwitch {
    versions: Versions<RouterPolicy>,
    decisions: Family<Labels, Counter>,
    rollout: arc_swap::ArcSwapOption<Rollout>,
    shadow: Family<Labels, Counter>,
    /// Every thread's instance slot, with its version, for [`PolicySwitch::retire_unused`].
    slots: Mutex<Vec<(Weak<Version>, Weak<Slot>)>>,
}

/// One thread's instance of a version. It is found by the version's identity: the `Weak`
/// keeps the version's allocation alive, so no other version (of this switch or of a switch
/// built later at the same address) can ever match it. The switch's address only decides
/// which entries a miss may evict.
struct Cached {
    owner: usize,
    version: Weak<Version>,
    slot: Arc<Slot>,
}

/// One thread's instance, shared with its switch so that retiring the version can drop it
/// while the thread is idle (the instance is taken: the slot is empty), or, if the thread is
/// in a call on it right then, mark it for the thread to drop after the call.
struct Slot {
    retired: AtomicBool,
    instance: Mutex<Option<RouterInstance>>,
}

thread_local! {
    /// This thread's instances, at most a few (the active version and a rollout candidate,
    /// per switch).
    static INSTANCES: RefCell<Vec<Cached>> = const { RefCell::new(Vec::new()) };
}

/// Instances one thread keeps before dropping the oldest.
const INSTANCES_PER_THREAD: usize = 4;

/// How a candidate version is tried before it is activated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RolloutMode {
    /// The candidate decides beside the active version; its answers are compared, not used.
    Shadow,
    /// The candidate decides `percent` of requests, chosen by the affinity key's hash.
    Split {
        /// Share of requests, 0..=100.
        percent: u8,
    },
}

/// A candidate version under trial.
#[derive(Debug)]
pub struct Rollout {
    /// The candidate.
    pub candidate: Arc<Version>,
    /// How it is tried.
    pub mode: RolloutMode,
    /// The request header whose hash makes split decisions sticky (none: per request).
    pub key_header: Option<String>,
}

impl PolicySwitch {
    /// A switch whose active version is `policy`.
    pub fn new(policy: RouterPolicy, config: SwitchConfig) -> PolicySwitch {
        PolicySwitch {
            versions: Versions::new("router", policy, config),
            decisions: Family::default(),
            rollout: arc_swap::ArcSwapOption::empty(),
            shadow: Family::default(),
            slots: Mutex::new(Vec::new()),
        }
    }

    /// Drops the instances of every version that no longer decides (neither active nor a
    /// rollout's candidate), on every thread. An instance in a call right now is marked, and
    /// its thread drops it when the call returns.
    fn retire_unused(&self) {
        let deciding = self.deciding();
        self.slots.lock().retain(|(version, slot)| {
            let Some(slot) = slot.upgrade() else {
                return false;
            };
            if version.upgrade().is_some_and(|v| deciding(&v)) {
                return true;
            }
            slot.retired.store(true, Ordering::Relaxed);
            if let Some(mut instance) = slot.instance.try_lock() {
                instance.take();
            }
            false
        });
    }

    /// Whether a version decides requests now: it is the active one or a rollout's candidate.
    fn deciding(&self) -> impl Fn(&Version) -> bool + use<> {
        let live = self.versions.active_generation();
        let candidate = self.rollout.load().as_ref().map(|r| r.candidate.generation);
        move |version| version.generation == live || Some(version.generation) == candidate
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
            self.versions.failures.clone(),
        );
        registry.register(
            "policy_shadow_comparisons",
            "Shadow candidate answers compared with the active version's: agree, disagree, failed",
            self.shadow.clone(),
        );
        registry.register(
            "policy_rollbacks",
            "Automatic rollbacks to a previous policy version",
            self.versions.rollbacks.clone(),
        );
    }

    /// The active version.
    pub fn active(&self) -> Arc<Version> {
        self.versions.active()
    }

    /// Whether a version deciding now (the active one, or a rollout's candidate) may send
    /// prompts to prefill workers: only then do its tables hold prefill rows.
    pub fn disaggregates(&self) -> bool {
        self.versions.active().policy.disaggregates()
            || self
                .rollout
                .load()
                .as_ref()
                .is_some_and(|r| r.candidate.policy.disaggregates())
    }

    /// The versions kept for rollback, oldest first.
    pub fn previous(&self) -> Vec<Arc<Version>> {
        self.versions.previous()
    }

    /// Makes `policy` the active version; the old one is kept for rollback. Requests already
    /// routed are unaffected; each thread switches on its next call.
    pub fn publish(&self, policy: Arc<RouterPolicy>) -> Arc<Version> {
        self.rollout.store(None);
        let version = self.versions.publish(policy);
        self.retire_unused();
        version
    }

    /// Restores the most recent previous version. Returns it, or `None` if there is none.
    pub fn rollback(&self) -> Option<Arc<Version>> {
        let restored = self.versions.rollback()?;
        self.rollout.store(None);
        self.retire_unused();
        Some(restored)
    }

    /// Starts trying `policy` as a candidate in `mode` (replacing any rollout in progress).
    pub fn start_rollout(
        &self,
        policy: Arc<RouterPolicy>,
        mode: RolloutMode,
        key_header: Option<String>,
    ) -> Arc<Rollout> {
        let candidate = self.versions.version(policy);
        let rollout = Arc::new(Rollout {
            candidate,
            mode,
            key_header,
        });
        tracing::info!(candidate = %rollout.candidate.label(), mode = ?rollout.mode, "policy rollout started");
        self.rollout.store(Some(rollout.clone()));
        self.retire_unused();
        rollout
    }

    /// The shadow candidate's answers so far, compared with the active version's: agreed,
    /// disagreed, failed.
    pub fn shadow_comparisons(&self, candidate: &Version) -> [u64; 3] {
        ["agree", "disagree", "failed"].map(|result| {
            self.shadow
                .get_or_create(&vec![("candidate", candidate.label()), ("result", result.into())])
                .get()
        })
    }

    /// Routing decisions `version` made itself, and those the fallback made for it.
    pub fn decision_counts(&self, version: &Version) -> [u64; 2] {
        [false, true].map(|fallback| version.decisions(&self.decisions, fallback).get())
    }

    /// The rollout in progress, if any.
    pub fn rollout(&self) -> Option<Arc<Rollout>> {
        self.rollout.load_full()
    }

    /// Ends a rollout without activating its candidate.
    pub fn stop_rollout(&self) {
        self.rollout.store(None);
        self.retire_unused();
    }

    /// Picks a worker index for `request`, whose prompt hashes to `prompt` (what the policy's
    /// `prompt` import answers), in the table `table` builds for the columns it is
    /// given (those the deciding versions read; the table must hold them and the
    /// [`table::fallback_columns`]): from the policy version in charge of the request (the active
    /// one, or a split candidate) when it answers sanely, from the native least-load fallback
    /// otherwise. `None` only when the table holds no LLM worker. A shadow candidate is also
    /// asked, and its answer only compared.
    pub fn route<T: Borrow<WorkerTable>>(
        &self,
        request: &RequestInfo,
        prompt: &[u64],
        table: impl FnOnce(Columns) -> T,
    ) -> (Option<Pick>, Routed) {
        let now_ms = self.versions.now_ms();
        let rollout = self.rollout.load();
        let version = match rollout.as_deref() {
            Some(Rollout {
                candidate,
                mode: RolloutMode::Split { percent },
                ..
            }) if split_draw(request) % 100 < u64::from(*percent) => Arc::clone(candidate),
            _ => self.versions.active(),
        };
        let mut columns = version.policy.columns();
        if let Some(Rollout {
            candidate,
            mode: RolloutMode::Shadow,
            ..
        }) = rollout.as_deref()
        {
            columns |= candidate.policy.columns();
        }
        let table = table(columns);
        let table = table.borrow();
        let outcome = self.call(&version, request, prompt, table, now_ms);
        if let Some(Rollout {
            candidate,
            mode: RolloutMode::Shadow,
            ..
        }) = rollout.as_deref()
        {
            let result = match (self.call(candidate, request, prompt, table, now_ms), &outcome) {
                (Ok(shadow), Ok(active)) if shadow == *active => "agree",
                (Ok(_), _) => "disagree",
                (Err(_), _) => "failed",
            };
            self.shadow
                .get_or_create(&vec![("candidate", candidate.label()), ("result", result.into())])
                .inc();
        }
        match outcome {
            Ok(pick) => {
                version.decisions(&self.decisions, false).inc();
                (Some(pick), Routed::Policy(version))
            }
            Err(kind) => {
                version.decisions(&self.decisions, true).inc();
                (table::least_load(table).map(Pick::only), Routed::Fallback(kind))
            }
        }
    }

    /// Calls `version` on this thread's instance of it, instantiating it if needed. A failure
    /// is recorded against the version and returned as its kind.
    fn call(
        &self,
        version: &Arc<Version>,
        request: &RequestInfo,
        prompt: &[u64],
        table: &WorkerTable,
        now_ms: u64,
    ) -> Result<Pick, &'static str> {
        let key = self as *const PolicySwitch as usize;
        let result = INSTANCES.with(|instances| {
            let mut instances = instances.borrow_mut();
            // Two rounds at most: a slot found empty (its version was retired, then made to
            // decide again) is dropped and the version instantiated afresh.
            for _ in 0..2 {
                let position = instances
                    .iter()
                    .position(|cached| std::ptr::eq(cached.version.as_ptr(), Arc::as_ptr(version)));
                let position = match position {
                    Some(position) => position,
                    None => {
                        if !version.may_instantiate(now_ms) {
                            return Err(None);
                        }
                        let instance = version.policy.instantiate().map_err(Some)?;
                        // Dropped here, oldest first: instances of versions nobody holds any
                        // more (a dropped switch's among them), and this switch's versions no
                        // longer in use.
                        let deciding = self.deciding();
                        instances.retain(|cached| {
                            cached
                                .version
                                .upgrade()
                                .is_some_and(|v| cached.owner != key || deciding(&v))
                        });
                        if instances.len() >= INSTANCES_PER_THREAD {
                            instances.remove(0);
                        }
                        let slot = Arc::new(Slot {
                            retired: AtomicBool::new(false),
                            instance: Mutex::new(Some(instance)),
                        });
                        {
                            let mut slots = self.slots.lock();
                            slots.retain(|(_, slot)| slot.strong_count() > 0);
                            slots.push((Arc::downgrade(version), Arc::downgrade(&slot)));
                        }
                        instances.push(Cached {
                            owner: key,
                            version: Arc::downgrade(version),
                            slot,
                        });
                        instances.len() - 1
                    }
                };
                let slot = &instances[position].slot;
                let outcome = slot
                    .instance
                    .lock()
                    .as_mut()
                    .map(|instance| instance.route(request, prompt, table));
                if slot.retired.load(Ordering::Relaxed) {
                    // Retired during the call: its memory goes back now.
                    instances.remove(position);
                    if let Some(outcome) = outcome {
                        return outcome.map_err(Some);
                    }
                    continue;
                }
                match outcome {
                    Some(Ok(pick)) => return Ok(pick),
                    Some(Err(err)) => {
                        // A trapped instance cannot be entered again; drop it either way.
                        instances.remove(position);
                        return Err(Some(err));
                    }
                    None => {
                        instances.remove(position);
                    }
                }
            }
            Err(None)
        });
        result.map_err(|failure| match failure {
            Some(err) => {
                self.record_failure(version, &err);
                err.kind()
            }
            None => "backoff",
        })
    }

    /// Counts a failure; the `max_failures`-th of a rollout candidate ends the rollout, that
    /// of the active version rolls back.
    fn record_failure(&self, version: &Arc<Version>, err: &crate::policy::PolicyError) {
        if !self.versions.record_failure(version, err) {
            return;
        }
        let is_candidate = self
            .rollout
            .load()
            .as_ref()
            .is_some_and(|r| Arc::ptr_eq(&r.candidate, version));
        if is_candidate {
            tracing::warn!(candidate = %version.label(), "rollout stopped: the candidate keeps failing");
            self.rollout.store(None);
        } else if self.versions.roll_back_if_active(version) {
            self.rollout.store(None);
        }
        self.retire_unused();
    }
}
