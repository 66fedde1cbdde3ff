//! Media features on an LLM worker: the lifecycle tracker and the position map.
//!
//! Features are pushed by encoders (see `switchyard_protocol::encode`) and live here until
//! their request has prefilled them. Each item moves `encoding → encoded_cpu → staged_gpu →
//! merged → prefilled | discarded` ([`FeatureState`]); the [`FeatureTracker`] refuses any other
//! move and keeps two byte counters against budgets: host memory for features that arrived
//! and device staging for features about to be merged. When host memory runs over, it evicts
//! the oldest arrived features, those nobody waits for first; evicting a waiting request's
//! features fails that request over to its fallback (it is never left waiting for bytes that
//! are gone). Features that arrive before their request (a feature-cache hit is faster than
//! the request's own trip) are held as orphans for a while and adopted when it comes.
//! [`build_position_map`] places each item's rows in the merged prompt: text − placeholders +
//! Σ media tokens, spans `[start, end)` in order.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_media::MediaId;
use tokio::sync::Notify;

/// Where one media item's features are in their lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureState {
    /// Expected: the encoder is working on it.
    Encoding,
    /// Arrived, in host memory.
    EncodedCpu,
    /// Copied to device staging memory.
    StagedGpu,
    /// Merged into the prompt's embeddings.
    Merged,
    /// Prefilled and kept (demoted to host memory) for a later turn.
    Prefilled,
    /// Freed.
    Discarded,
}

impl FeatureState {
    /// The name used in logs and errors.
    pub fn as_str(self) -> &'static str {
        match self {
            FeatureState::Encoding => "encoding",
            FeatureState::EncodedCpu => "encoded_cpu",
            FeatureState::StagedGpu => "staged_gpu",
            FeatureState::Merged => "merged",
            FeatureState::Prefilled => "prefilled",
            FeatureState::Discarded => "discarded",
        }
    }
}

/// What went wrong with a tracker call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrackerError {
    /// The move is not part of the lifecycle.
    #[error("cannot {action} a feature in state {}", state.as_str())]
    IllegalTransition {
        /// What was asked.
        action: &'static str,
        /// Where the feature was.
        state: FeatureState,
    },
    /// Device staging memory is full.
    #[error("GPU staging full: {used} of {budget} bytes used, {needed} more needed")]
    StagingFull {
        /// Bytes staged.
        used: u64,
        /// The budget.
        budget: u64,
        /// Bytes the move needed.
        needed: u64,
    },
    /// The request or item is not tracked.
    #[error("no tracked features for request `{0}`")]
    Unknown(String),
    /// The features do not match the item they were pushed for.
    #[error("features for slot {slot} do not match the plan: {reason}")]
    Mismatch {
        /// The slot.
        slot: usize,
        /// How.
        reason: String,
    },
}

/// Budgets of a tracker.
#[derive(Debug, Clone, Copy)]
pub struct TrackerConfig {
    /// Host memory for arrived features.
    pub cpu_budget_bytes: u64,
    /// Device staging memory.
    pub gpu_budget_bytes: u64,
    /// Keep features after prefill (demoted to host memory) instead of freeing them.
    pub keep_after_prefill: bool,
    /// How long features that arrived for an unknown request are held.
    pub orphan_ttl: Duration,
}

impl Default for TrackerConfig {
    fn default() -> TrackerConfig {
        TrackerConfig {
            cpu_budget_bytes: 16 << 30,
            gpu_budget_bytes: 4 << 30,
            keep_after_prefill: false,
            orphan_ttl: Duration::from_secs(30),
        }
    }
}

/// One item's features.
#[derive(Debug)]
struct Feature {
    state: FeatureState,
    media_id: MediaId,
    tokens: u32,
    bytes: u64,
    arrived: Instant,
    data: Option<bytes::Bytes>,
}

/// Whether a request can go on, and if not why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Some features have not arrived.
    Waiting,
    /// Every item's features arrived.
    Ready,
    /// The media will not come (abandoned by the gateway, or evicted): answer text-only.
    Failed(String),
}

#[derive(Debug)]
struct Tracked {
    slots: Vec<Feature>,
    failed: Option<String>,
    notify: Arc<Notify>,
}

/// Live byte counters of a tracker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrackerStats {
    /// Host memory held by features.
    pub cpu_used: u64,
    /// Device staging memory held by features.
    pub gpu_used: u64,
    /// Requests tracked.
    pub requests: usize,
    /// Features held for requests not seen yet.
    pub orphans: usize,
    /// Features evicted for room.
    pub evictions: u64,
}

/// The feature lifecycle of one worker; see the module docs.
#[derive(Debug)]
pub struct FeatureTracker {
    config: TrackerConfig,
    requests: HashMap<String, Tracked>,
    orphans: HashMap<(String, usize), Feature>,
    /// Requests the gateway gave up on before they arrived, with why and when.
    abandoned: HashMap<String, (String, Instant)>,
    cpu_used: u64,
    gpu_used: u64,
    evictions: u64,
}

impl FeatureTracker {
    /// An empty tracker.
    pub fn new(config: TrackerConfig) -> FeatureTracker {
        FeatureTracker {
            config,
            requests: HashMap::new(),
            orphans: HashMap::new(),
            abandoned: HashMap::new(),
            cpu_used: 0,
            gpu_used: 0,
            evictions: 0,
        }
    }

    /// The byte counters.
    pub fn stats(&self) -> TrackerStats {
        TrackerStats {
            cpu_used: self.cpu_used,
            gpu_used: self.gpu_used,
            requests: self.requests.len(),
            orphans: self.orphans.len(),
            evictions: self.evictions,
        }
    }

    /// Starts tracking `request`, expecting one item per `(media id, tokens)`; features that
    /// arrived before it are adopted. Returns what to wait on for changes.
    pub fn register(&mut self, request: &str, items: &[(MediaId, u32)]) -> Arc<Notify> {
        self.expire_orphans();
        let notify = Arc::new(Notify::new());
        let slots = items
            .iter()
            .enumerate()
            .map(
                |(slot, &(media_id, tokens))| match self.orphans.remove(&(request.to_string(), slot)) {
                    Some(feature) => feature,
                    None => Feature {
                        state: FeatureState::Encoding,
                        media_id,
                        tokens,
                        bytes: 0,
                        arrived: Instant::now(),
                        data: None,
                    },
                },
            )
            .collect();
        let failed = self.abandoned.remove(request).map(|(reason, _)| reason);
        self.requests.insert(
            request.to_string(),
            Tracked {
                slots,
                failed,
                notify: notify.clone(),
            },
        );
        notify
    }

    /// Takes an item's features (`encoding → encoded_cpu`), evicting for room if host memory
    /// runs over. Features for a request not registered yet are held as an orphan.
    ///
    /// # Errors
    ///
    /// [`TrackerError::Mismatch`] if the slot does not exist or names another media item,
    /// [`TrackerError::IllegalTransition`] if the item's features already arrived.
    pub fn deliver(
        &mut self,
        request: &str,
        slot: usize,
        media_id: MediaId,
        tokens: u32,
        data: bytes::Bytes,
    ) -> Result<(), TrackerError> {
        let bytes = data.len() as u64;
        let feature = Feature {
            state: FeatureState::EncodedCpu,
            media_id,
            tokens,
            bytes,
            arrived: Instant::now(),
            data: Some(data),
        };
        match self.requests.get_mut(request) {
            None => {
                self.expire_orphans();
                if let Some(old) = self.orphans.insert((request.to_string(), slot), feature) {
                    self.cpu_used -= old.bytes;
                }
            }
            Some(tracked) => {
                let Some(existing) = tracked.slots.get_mut(slot) else {
                    return Err(TrackerError::Mismatch {
                        slot,
                        reason: format!("the plan has {} items", tracked.slots.len()),
                    });
                };
                if existing.media_id != media_id {
                    return Err(TrackerError::Mismatch {
                        slot,
                        reason: format!("expected media {}, got {media_id}", existing.media_id),
                    });
                }
                if existing.state != FeatureState::Encoding {
                    return Err(TrackerError::IllegalTransition {
                        action: "deliver",
                        state: existing.state,
                    });
                }
                *existing = feature;
                tracked.notify.notify_one();
            }
        }
        self.cpu_used += bytes;
        self.evict_for_room(request, slot);
        Ok(())
    }

    /// Frees the oldest arrived features while host memory is over budget: orphans first, then
    /// those of other waiting requests (which fail over), never the one just delivered.
    fn evict_for_room(&mut self, keep_request: &str, keep_slot: usize) {
        while self.cpu_used > self.config.cpu_budget_bytes {
            let oldest_orphan = self
                .orphans
                .iter()
                .filter(|(key, _)| !(key.0 == keep_request && key.1 == keep_slot))
                .min_by_key(|(_, feature)| feature.arrived)
                .map(|(key, _)| key.clone());
            if let Some(key) = oldest_orphan {
                if let Some(feature) = self.orphans.remove(&key) {
                    self.cpu_used -= feature.bytes;
                    self.evictions += 1;
                }
                continue;
            }
            let oldest = self
                .requests
                .iter()
                .flat_map(|(request, tracked)| {
                    tracked
                        .slots
                        .iter()
                        .enumerate()
                        .filter(|(_, f)| f.state == FeatureState::EncodedCpu)
                        .map(move |(slot, f)| (request.clone(), slot, f.arrived))
                })
                .filter(|(request, slot, _)| !(request == keep_request && *slot == keep_slot))
                .min_by_key(|(_, _, arrived)| *arrived);
            let Some((request, slot, _)) = oldest else {
                return;
            };
            if let Some(tracked) = self.requests.get_mut(&request) {
                let feature = &mut tracked.slots[slot];
                self.cpu_used -= feature.bytes;
                feature.data = None;
                feature.state = FeatureState::Discarded;
                self.evictions += 1;
                tracked.failed = Some("feature-evicted".into());
                tracked.notify.notify_one();
            }
        }
    }

    /// Whether `request` can go on.
    pub fn readiness(&self, request: &str) -> Readiness {
        let Some(tracked) = self.requests.get(request) else {
            return Readiness::Failed("not tracked".into());
        };
        if let Some(reason) = &tracked.failed {
            return Readiness::Failed(reason.clone());
        }
        if tracked.slots.iter().all(|f| f.state != FeatureState::Encoding) {
            Readiness::Ready
        } else {
            Readiness::Waiting
        }
    }

    /// The gateway gave up on `request`'s media. A request not seen yet is remembered for a
    /// while, so that it fails over as soon as it arrives.
    pub fn abandon(&mut self, request: &str, reason: &str) {
        match self.requests.get_mut(request) {
            Some(tracked) => {
                tracked.failed.get_or_insert_with(|| reason.to_string());
                tracked.notify.notify_one();
            }
            None => {
                self.expire_orphans();
                self.abandoned
                    .insert(request.to_string(), (reason.to_string(), Instant::now()));
            }
        }
    }

    /// The rows each item arrived with, in slot order.
    pub fn arrived_tokens(&self, request: &str) -> Option<Vec<u32>> {
        let tracked = self.requests.get(request)?;
        Some(tracked.slots.iter().map(|f| f.tokens).collect())
    }

    /// Copies every arrived item of `request` to device staging (`encoded_cpu → staged_gpu`).
    ///
    /// # Errors
    ///
    /// [`TrackerError::IllegalTransition`] if an item is in any other state,
    /// [`TrackerError::StagingFull`] if they do not fit (nothing moves then).
    pub fn stage(&mut self, request: &str) -> Result<(), TrackerError> {
        let tracked = self
            .requests
            .get_mut(request)
            .ok_or_else(|| TrackerError::Unknown(request.to_string()))?;
        if let Some(f) = tracked.slots.iter().find(|f| f.state != FeatureState::EncodedCpu) {
            return Err(TrackerError::IllegalTransition {
                action: "stage",
                state: f.state,
            });
        }
        let needed: u64 = tracked.slots.iter().map(|f| f.bytes).sum();
        if self.gpu_used + needed > self.config.gpu_budget_bytes {
            return Err(TrackerError::StagingFull {
                used: self.gpu_used,
                budget: self.config.gpu_budget_bytes,
                needed,
            });
        }
        for f in &mut tracked.slots {
            f.state = FeatureState::StagedGpu;
        }
        self.cpu_used -= needed;
        self.gpu_used += needed;
        Ok(())
    }

    /// Marks `request`'s staged items merged (`staged_gpu → merged`); the staging bytes stay
    /// counted until prefill. Returns the features, in slot order.
    ///
    /// # Errors
    ///
    /// [`TrackerError::IllegalTransition`] if an item is not staged.
    pub fn merge(&mut self, request: &str) -> Result<Vec<bytes::Bytes>, TrackerError> {
        let tracked = self
            .requests
            .get_mut(request)
            .ok_or_else(|| TrackerError::Unknown(request.to_string()))?;
        if let Some(f) = tracked.slots.iter().find(|f| f.state != FeatureState::StagedGpu) {
            return Err(TrackerError::IllegalTransition {
                action: "merge",
                state: f.state,
            });
        }
        Ok(tracked
            .slots
            .iter_mut()
            .map(|f| {
                f.state = FeatureState::Merged;
                f.data.clone().unwrap_or_default()
            })
            .collect())
    }

    /// `request` has prefilled (`merged → prefilled | discarded`): its features are kept in
    /// host memory or freed, per the configuration.
    ///
    /// # Errors
    ///
    /// [`TrackerError::IllegalTransition`] if an item is not merged.
    pub fn prefilled(&mut self, request: &str) -> Result<(), TrackerError> {
        let keep = self.config.keep_after_prefill;
        let tracked = self
            .requests
            .get_mut(request)
            .ok_or_else(|| TrackerError::Unknown(request.to_string()))?;
        if let Some(f) = tracked.slots.iter().find(|f| f.state != FeatureState::Merged) {
            return Err(TrackerError::IllegalTransition {
                action: "finish prefill of",
                state: f.state,
            });
        }
        for f in &mut tracked.slots {
            self.gpu_used -= f.bytes;
            if keep {
                self.cpu_used += f.bytes;
                f.state = FeatureState::Prefilled;
            } else {
                f.data = None;
                f.state = FeatureState::Discarded;
            }
        }
        Ok(())
    }

    /// Forgets `request`, freeing whatever it still holds (its answer is over, or it was
    /// cancelled).
    pub fn release(&mut self, request: &str) {
        let Some(tracked) = self.requests.remove(request) else {
            return;
        };
        for f in tracked.slots {
            match f.state {
                FeatureState::EncodedCpu | FeatureState::Prefilled => self.cpu_used -= f.bytes,
                FeatureState::StagedGpu | FeatureState::Merged => self.gpu_used -= f.bytes,
                FeatureState::Encoding | FeatureState::Discarded => {}
            }
        }
    }

    fn expire_orphans(&mut self) {
        let ttl = self.config.orphan_ttl;
        let mut freed = 0;
        self.orphans.retain(|_, feature| {
            let keep = feature.arrived.elapsed() < ttl;
            if !keep {
                freed += feature.bytes;
            }
            keep
        });
        self.cpu_used -= freed;
        self.abandoned.retain(|_, (_, at)| at.elapsed() < ttl);
    }
}

/// One media item's place in the merged prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PositionEntry {
    /// Which placeholder (in order).
    pub slot: usize,
    /// Its rows.
    pub tokens: u32,
    /// Its span `[start, end)` in the merged prompt.
    pub span: Range<u32>,
}

/// Where every media item goes when the placeholders of `prompt` (one token each, those for
/// which `is_placeholder` holds) are replaced by `tokens[k]` rows each: the entries in order
/// and the merged length (`prompt.len() − placeholders + Σ tokens`). `None` if the prompt does
/// not hold exactly one placeholder per item.
pub fn build_position_map(
    prompt: &[u32],
    is_placeholder: impl Fn(u32) -> bool,
    tokens: &[u32],
) -> Option<(Vec<PositionEntry>, usize)> {
    let mut entries = Vec::with_capacity(tokens.len());
    let mut merged: usize = 0;
    for &token in prompt {
        if is_placeholder(token) {
            let slot = entries.len();
            let rows = *tokens.get(slot)?;
            let start = u32::try_from(merged).ok()?;
            merged += rows as usize;
            entries.push(PositionEntry {
                slot,
                tokens: rows,
                span: start..u32::try_from(merged).ok()?,
            });
        } else {
            merged += 1;
        }
    }
    (entries.len() == tokens.len()).then_some((entries, merged))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(cpu: u64, gpu: u64) -> FeatureTracker {
        FeatureTracker::new(TrackerConfig {
            cpu_budget_bytes: cpu,
            gpu_budget_bytes: gpu,
            ..TrackerConfig::default()
        })
    }

    fn bytes(n: usize) -> bytes::Bytes {
        bytes::Bytes::from(vec![0u8; n])
    }

    #[test]
    fn the_lifecycle_runs_in_order_and_returns_memory() {
        let mut t = tracker(1000, 1000);
        t.register("r", &[(MediaId(1), 4), (MediaId(2), 2)]);
        assert_eq!(t.readiness("r"), Readiness::Waiting);
        assert!(matches!(
            t.stage("r"),
            Err(TrackerError::IllegalTransition {
                state: FeatureState::Encoding,
                ..
            })
        ));
        t.deliver("r", 0, MediaId(1), 4, bytes(100)).expect("delivered");
        t.deliver("r", 1, MediaId(2), 2, bytes(50)).expect("delivered");
        assert_eq!(t.readiness("r"), Readiness::Ready);
        assert_eq!(t.stats().cpu_used, 150);
        t.stage("r").expect("fits");
        assert_eq!((t.stats().cpu_used, t.stats().gpu_used), (0, 150));
        assert_eq!(t.merge("r").expect("staged").len(), 2);
        t.prefilled("r").expect("merged");
        assert_eq!((t.stats().cpu_used, t.stats().gpu_used), (0, 0));
        t.release("r");
        assert_eq!(t.stats(), TrackerStats::default());
    }

    #[test]
    fn illegal_moves_are_refused() {
        let mut t = tracker(1000, 1000);
        t.register("r", &[(MediaId(1), 4)]);
        assert!(t.merge("r").is_err());
        assert!(t.prefilled("r").is_err());
        t.deliver("r", 0, MediaId(1), 4, bytes(10)).expect("delivered");
        assert!(matches!(
            t.deliver("r", 0, MediaId(1), 4, bytes(10)),
            Err(TrackerError::IllegalTransition { .. })
        ));
        assert!(matches!(
            t.deliver("r", 3, MediaId(1), 4, bytes(10)),
            Err(TrackerError::Mismatch { .. })
        ));
        assert!(matches!(
            t.deliver("r", 0, MediaId(9), 4, bytes(10)),
            Err(TrackerError::Mismatch { .. })
        ));
        t.release("r");
        assert_eq!(t.stats().cpu_used, 0);
    }

    #[test]
    fn staging_over_budget_moves_nothing() {
        let mut t = tracker(1000, 100);
        t.register("r", &[(MediaId(1), 4)]);
        t.deliver("r", 0, MediaId(1), 4, bytes(150)).expect("delivered");
        assert!(matches!(t.stage("r"), Err(TrackerError::StagingFull { .. })));
        assert_eq!((t.stats().cpu_used, t.stats().gpu_used), (150, 0));
        t.release("r");
        assert_eq!(t.stats().cpu_used, 0);
    }

    #[test]
    fn eviction_takes_orphans_first_then_fails_the_waiting_request_over() {
        let mut t = tracker(250, 1000);
        t.deliver("early", 0, MediaId(7), 1, bytes(100)).expect("orphan kept");
        t.register("a", &[(MediaId(1), 1), (MediaId(2), 1)]);
        t.register("b", &[(MediaId(3), 1)]);
        t.deliver("a", 0, MediaId(1), 1, bytes(100)).expect("delivered");
        t.deliver("b", 0, MediaId(3), 1, bytes(100)).expect("delivered");
        assert_eq!(t.stats().orphans, 0, "the orphan went first");
        assert_eq!(t.readiness("a"), Readiness::Waiting);
        t.deliver("a", 1, MediaId(2), 1, bytes(100)).expect("delivered");
        // a's slot 0 was the oldest: a fails over rather than waiting for bytes that are gone.
        assert_eq!(t.readiness("a"), Readiness::Failed("feature-evicted".into()));
        assert_eq!(t.readiness("b"), Readiness::Ready);
        assert_eq!(t.stats().evictions, 2);
        t.release("a");
        t.release("b");
        assert_eq!(t.stats().cpu_used, 0);
    }

    #[test]
    fn early_features_are_adopted() {
        let mut t = tracker(1000, 1000);
        t.deliver("r", 1, MediaId(2), 3, bytes(60)).expect("orphan kept");
        t.register("r", &[(MediaId(1), 4), (MediaId(2), 3)]);
        t.deliver("r", 0, MediaId(1), 4, bytes(80)).expect("delivered");
        assert_eq!(t.readiness("r"), Readiness::Ready);
        assert_eq!(t.arrived_tokens("r"), Some(vec![4, 3]));
        t.abandon("r", "x");
        assert_eq!(t.readiness("r"), Readiness::Failed("x".into()));
        t.release("r");
        assert_eq!(t.stats().cpu_used, 0);
        // Given up on before it arrived: it fails over at once.
        t.abandon("late", "encoder-failed");
        t.register("late", &[(MediaId(1), 4)]);
        assert_eq!(t.readiness("late"), Readiness::Failed("encoder-failed".into()));
    }

    #[test]
    fn the_worked_example_merges_to_4883_tokens() {
        // 7 text tokens, an image of 1,024 rows, 8 text, a video of 3,840, 4 text.
        const P: u32 = u32::MAX;
        let mut prompt = vec![1; 7];
        prompt.push(P);
        prompt.extend([2; 8]);
        prompt.push(P);
        prompt.extend([3; 4]);
        let (entries, len) = build_position_map(&prompt, |t| t == P, &[1024, 3840]).expect("one per item");
        assert_eq!(len, 4883);
        assert_eq!(entries[0].span, 7..1031);
        assert_eq!(entries[1].span, 1039..4879);
        // The seed's demo: 8 tokens with one placeholder and a 3,840-row video.
        let mut demo = vec![1; 7];
        demo.insert(3, P);
        assert_eq!(build_position_map(&demo, |t| t == P, &[3840]).expect("one").1, 3847);
        assert!(build_position_map(&demo, |t| t == P, &[1, 2]).is_none());
    }
}
