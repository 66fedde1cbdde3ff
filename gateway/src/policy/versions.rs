//! Published versions of one live policy: the active one, the few kept for rollback, and the
//! failure bookkeeping that restores the previous version automatically.
//!
//! [`Versions`] is shared by the router switch ([`crate::policy::switch`]) and the encoder
//! batcher switch ([`crate::policy::batching`]): a publish swaps the active version behind an
//! `ArcSwap` (threads notice by its generation, one atomic load per call), a failure is
//! counted against the version that failed and delays its re-instantiation by a doubling
//! backoff, and the `max_failures`-th failure of the active version rolls back to the previous.
//! The newest version that served without a failure stays kept for rollback however many
//! versions follow it, so a streak of bad versions longer than the rollback depth still rolls
//! back to it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::policy::PolicyError;

/// Metric labels.
pub(crate) type Labels = Vec<(&'static str, String)>;

/// What a published policy is called by.
pub trait Named {
    /// The policy's name.
    fn name(&self) -> &str;
    /// The sha256 of the `.wasm` it was loaded from.
    fn sha256(&self) -> &str;
}

/// One published version of a policy.
#[derive(Debug)]
pub struct Version<P> {
    /// Increases with every publish; threads compare it to notice a swap.
    pub generation: u64,
    /// The compiled policy.
    pub policy: Arc<P>,
    failures: AtomicU32,
    /// Milliseconds since the switch's start before which no thread re-instantiates.
    retry_after_ms: AtomicU64,
    /// Its decision counters (decided by the policy, by the fallback), looked up once: a
    /// lookup builds the label strings, which costs more than the call it counts.
    decisions: std::sync::OnceLock<[Counter; 2]>,
    /// Its `x-switchyard-policy` header value, made once (see [`Version::header_value`]).
    header: std::sync::OnceLock<Option<http::HeaderValue>>,
}

impl<P: Named> Version<P> {
    pub(crate) fn new(generation: u64, policy: Arc<P>) -> Arc<Version<P>> {
        Arc::new(Version {
            generation,
            policy,
            failures: AtomicU32::new(0),
            retry_after_ms: AtomicU64::new(0),
            decisions: std::sync::OnceLock::new(),
            header: std::sync::OnceLock::new(),
        })
    }

    /// Its counter in `family` (labels `version` and `outcome`) of decisions made by the
    /// policy, or by the fallback when `fallback`.
    pub(crate) fn decisions(&self, family: &Family<Labels, Counter>, fallback: bool) -> &Counter {
        let counters = self.decisions.get_or_init(|| {
            ["policy", "fallback"].map(|outcome| {
                family
                    .get_or_create(&vec![("version", self.label()), ("outcome", outcome.to_string())])
                    .clone()
            })
        });
        &counters[usize::from(fallback)]
    }

    /// A label for metrics and logs: `name@sha256-prefix`.
    pub fn label(&self) -> String {
        let sha256 = self.policy.sha256();
        format!("{}@{}", self.policy.name(), &sha256[..12.min(sha256.len())])
    }

    /// `name@sha256-prefix#generation`, for the response header naming what routed a request
    /// (`None` for a name a header cannot carry): made on first use and shared, so a
    /// request's copy allocates nothing.
    pub fn header_value(&self) -> Option<http::HeaderValue> {
        self.header
            .get_or_init(|| http::HeaderValue::from_str(&format!("{}#{}", self.label(), self.generation)).ok())
            .clone()
    }

    /// Failures counted against this version.
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Whether this version has decided at least once by itself and never failed: the sign of
    /// a version worth keeping for rollback.
    pub(crate) fn served_cleanly(&self) -> bool {
        self.failures() == 0 && self.decisions.get().is_some_and(|[by_policy, _]| by_policy.get() > 0)
    }

    /// Whether a thread may instantiate this version at `now_ms` (its backoff has passed).
    pub(crate) fn may_instantiate(&self, now_ms: u64) -> bool {
        now_ms >= self.retry_after_ms.load(Ordering::Relaxed)
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

/// The active version of a policy and those kept for rollback; see the module docs.
#[derive(Debug)]
pub struct Versions<P> {
    /// What the policy is, in logs (`router`, `batcher`).
    what: &'static str,
    active: ArcSwap<Version<P>>,
    previous: Mutex<VecDeque<Arc<Version<P>>>>,
    /// The newest version that had served cleanly ([`Version::served_cleanly`]) when it was
    /// replaced: while it is in `previous`, older versions are dropped past the rollback depth,
    /// never it.
    last_good: Mutex<Option<Arc<Version<P>>>>,
    next_generation: AtomicU64,
    config: SwitchConfig,
    started: Instant,
    pub(crate) failures: Family<Labels, Counter>,
    pub(crate) rollbacks: Counter,
}

impl<P: Named> Versions<P> {
    /// Versions of a `what` policy whose first active version is `policy`.
    pub(crate) fn new(what: &'static str, policy: P, config: SwitchConfig) -> Versions<P> {
        Versions {
            what,
            active: ArcSwap::new(Version::new(1, Arc::new(policy))),
            previous: Mutex::new(VecDeque::new()),
            last_good: Mutex::new(None),
            next_generation: AtomicU64::new(2),
            config,
            started: Instant::now(),
            failures: Family::default(),
            rollbacks: Counter::default(),
        }
    }

    /// Milliseconds since the versions were created (the clock backoffs are set on).
    pub(crate) fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The active version.
    pub fn active(&self) -> Arc<Version<P>> {
        self.active.load_full()
    }

    /// The active version's generation (one atomic load).
    pub(crate) fn active_generation(&self) -> u64 {
        self.active.load().generation
    }

    /// The versions kept for rollback, oldest first.
    pub fn previous(&self) -> Vec<Arc<Version<P>>> {
        self.previous
            .lock()
            .map(|versions| versions.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// A version of `policy` with a fresh generation, not published.
    pub(crate) fn version(&self, policy: Arc<P>) -> Arc<Version<P>> {
        Version::new(self.next_generation.fetch_add(1, Ordering::Relaxed), policy)
    }

    /// Makes `policy` the active version; the old one is kept for rollback. Past the rollback
    /// depth the oldest kept version is dropped, unless it is the last good one.
    pub fn publish(&self, policy: Arc<P>) -> Arc<Version<P>> {
        let version = self.version(policy);
        let old = self.active.swap(version.clone());
        if let (Ok(mut previous), Ok(mut last_good)) = (self.previous.lock(), self.last_good.lock()) {
            if old.served_cleanly() {
                *last_good = Some(old.clone());
            }
            previous.push_back(old);
            while previous.len() > self.config.keep_versions {
                let pinned = |kept: &Arc<Version<P>>| last_good.as_ref().is_some_and(|good| Arc::ptr_eq(good, kept));
                match previous.iter().position(|kept| !pinned(kept)) {
                    Some(oldest) => {
                        previous.remove(oldest);
                    }
                    // Only the last good version is left: it stays.
                    None => break,
                }
            }
        }
        tracing::info!(version = %version.label(), generation = version.generation, "{} policy published", self.what);
        version
    }

    /// Restores the most recent previous version. Returns it, or `None` if there is none.
    pub fn rollback(&self) -> Option<Arc<Version<P>>> {
        let restored = self.previous.lock().ok()?.pop_back()?;
        restored.failures.store(0, Ordering::Relaxed);
        restored.retry_after_ms.store(0, Ordering::Relaxed);
        let failed = self.active.swap(restored.clone());
        tracing::warn!(from = %failed.label(), to = %restored.label(), "{} policy rolled back", self.what);
        Some(restored)
    }

    /// Counts `err` against `version`, delays its next instantiation, and answers whether this
    /// was its `max_failures`-th failure (the caller decides what that ends; see
    /// [`Versions::roll_back_if_active`]).
    pub(crate) fn record_failure(&self, version: &Arc<Version<P>>, err: &PolicyError) -> bool {
        self.failures
            .get_or_create(&vec![("version", version.label()), ("kind", err.kind().to_string())])
            .inc();
        if matches!(err, PolicyError::Capacity(_)) {
            // The gateway ran out of instance slots; the policy did nothing wrong. Counted
            // (kind "capacity") and served by the fallback, with no backoff and no step
            // toward rollback.
            tracing::warn!(version = %version.label(), error = %err, "{} policy call served by the fallback: no instance slot", self.what);
            return false;
        }
        let failures = version.failures.fetch_add(1, Ordering::Relaxed) + 1;
        let backoff = self
            .config
            .backoff
            .saturating_mul(1 << failures.min(7))
            .min(Duration::from_secs(1));
        version
            .retry_after_ms
            .store(self.now_ms() + backoff.as_millis() as u64, Ordering::Relaxed);
        tracing::warn!(version = %version.label(), failures, error = %err, "{} policy failed; served by the fallback", self.what);
        failures == self.config.max_failures
    }

    /// Rolls back if `version` is still the active one (and counts the rollback); answers
    /// whether it did.
    pub(crate) fn roll_back_if_active(&self, version: &Arc<Version<P>>) -> bool {
        let rolled_back = Arc::ptr_eq(&self.active.load_full(), version) && self.rollback().is_some();
        if rolled_back {
            self.rollbacks.inc();
        }
        rolled_back
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Named(&'static str);

    impl super::Named for Named {
        fn name(&self) -> &str {
            self.0
        }
        fn sha256(&self) -> &str {
            "0123456789abcdef"
        }
    }

    fn decided(versions: &Versions<Named>, family: &Family<Labels, Counter>) {
        versions.active().decisions(family, false).inc();
    }

    #[test]
    fn the_last_good_version_is_kept_past_the_rollback_depth() {
        let versions = Versions::new("router", Named("first"), SwitchConfig::default());
        let family = Family::default();
        versions.publish(Arc::new(Named("good")));
        decided(&versions, &family);
        // More bad versions than are kept, none of which ever served cleanly.
        let bad = SwitchConfig::default().keep_versions + 1;
        for _ in 0..bad {
            versions.publish(Arc::new(Named("bad")));
            let active = versions.active();
            active.decisions(&family, true).inc();
            versions.record_failure(&active, &PolicyError::Trap("hostile".into()));
        }
        let kept: Vec<String> = versions.previous().iter().map(|v| v.policy.0.to_string()).collect();
        assert!(kept.contains(&"good".to_string()), "kept: {kept:?}");
        // Rolling back through the bad ones ends at the good one, however many there were.
        let mut restored = Vec::new();
        while let Some(version) = versions.rollback() {
            restored.push(version.policy.0);
        }
        assert_eq!(restored.last(), Some(&"good"), "restored in turn: {restored:?}");
        assert_eq!(versions.active().policy.0, "good");
    }
}
