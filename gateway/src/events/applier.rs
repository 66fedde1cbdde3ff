//! The event applier: keeps the index in step with each worker's event stream.
//!
//! One task owns this. Every transport sends it [`Inbound`] messages: KV events, dumps,
//! registrations (heartbeats), goodbyes, lost workers and replicas' active-sequence updates.
//! Per worker it tracks the last applied `event_id`. The next id is applied; an older one is
//! a duplicate (or, at id 1, a restarted worker whose old blocks are dropped); a jump is a gap:
//! the worker's events are buffered while its [`DumpSource`] fetches a dump, the dump replaces
//! the worker's blocks, and the buffered events newer than the dump follow. A source that
//! cannot dump (vLLM) instead drops the worker's blocks and goes on from the new event.
//! Registered workers that stop heartbeating leave the pool and the index, so cache affinity
//! can never pick them. Consecutive events are applied in batches of at most [`MAX_BATCH`]
//! (one metrics update per batch); the index locks per block, so lookups never wait for a
//! batch.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use switchyard_protocol::kv_events::{KvDump, KvEvent, Registration, StorageTier, WorkerEvent, valid_worker_name};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
// tokio's clock, so heartbeat expiry and resync backoff follow a paused clock in tests.
use tokio::time::Instant;

use crate::config::WorkerConfig;
use crate::kv::index::{Anomaly, WorkerId};
use crate::kv::{ActiveUpdate, KvState};
use crate::workers::WorkerPool;

/// Most events applied (and counted in the metrics) per batch.
pub const MAX_BATCH: usize = 256;

/// Least time between two dump requests for one worker.
const RESYNC_BACKOFF: Duration = Duration::from_secs(1);

/// A boxed future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Where a worker's dump comes from: the transport its events arrive on.
pub trait DumpSource: Send + Sync + std::fmt::Debug {
    /// Asks `worker` for its whole cache.
    fn request(&self, worker: String) -> BoxFuture<Result<KvDump, String>>;

    /// Whether this source can answer dumps at all.
    fn answers_dumps(&self) -> bool {
        true
    }
}

/// A message for the applier.
#[derive(Debug)]
pub enum Inbound {
    /// A KV event, and the transport that carried it.
    Event(WorkerEvent, Arc<dyn DumpSource>),
    /// The answer to a dump request.
    Dump {
        /// The worker.
        worker: String,
        /// The dump, or why there is none.
        result: Result<KvDump, String>,
    },
    /// A worker's registration or heartbeat, and the transport that carried it.
    Heartbeat(Registration, Arc<dyn DumpSource>),
    /// A worker said goodbye.
    Leave(String),
    /// A worker stopped answering requests (ejected): its blocks leave the index.
    Lost(String),
    /// Another gateway's active-sequence update.
    Active(ActiveUpdate),
}

/// Applier settings.
#[derive(Debug, Clone)]
pub struct SyncConfig {
    /// Heartbeats a registered worker may miss.
    pub heartbeat_misses: u32,
    /// Events buffered per worker during a resync.
    pub resync_buffer: usize,
    /// How long a dump is awaited.
    pub resync_timeout: Duration,
}

#[derive(Debug)]
struct Resync {
    buffer: Vec<WorkerEvent>,
    overflowed: bool,
    in_flight: bool,
    last_request: Option<Instant>,
}

#[derive(Debug)]
struct Track {
    kv_id: WorkerId,
    last_event_id: u64,
    source: Arc<dyn DumpSource>,
    indexable: bool,
    resync: Option<Resync>,
    heartbeat: Option<(Duration, Instant)>,
    tail_suspect: Option<u64>,
}

/// Starts the applier; returns the sender every transport uses.
pub fn spawn(
    state: Arc<KvState>,
    pool: Arc<WorkerPool>,
    config: SyncConfig,
) -> (mpsc::UnboundedSender<Inbound>, JoinHandle<()>) {
    let (sender, receiver) = mpsc::unbounded_channel();
    let applier = Applier {
        state,
        pool,
        config,
        tracks: HashMap::new(),
        batch: Vec::new(),
        sender: sender.clone(),
    };
    (sender, tokio::spawn(applier.run(receiver)))
}

struct Applier {
    state: Arc<KvState>,
    pool: Arc<WorkerPool>,
    config: SyncConfig,
    tracks: HashMap<String, Track>,
    batch: Vec<(String, WorkerId, StorageTier, KvEvent)>,
    sender: mpsc::UnboundedSender<Inbound>,
}

impl Applier {
    async fn run(mut self, mut receiver: mpsc::UnboundedReceiver<Inbound>) {
        let mut ticker = tokio::time::interval(Duration::from_millis(200));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut messages = Vec::with_capacity(MAX_BATCH);
        loop {
            tokio::select! {
                received = receiver.recv_many(&mut messages, MAX_BATCH) => {
                    if received == 0 {
                        break;
                    }
                    for message in messages.drain(..) {
                        self.handle(message);
                    }
                    self.flush();
                }
                _ = ticker.tick() => self.tick(),
            }
        }
    }

    fn handle(&mut self, message: Inbound) {
        match message {
            Inbound::Event(event, source) => self.event(event, &source),
            Inbound::Dump { worker, result } => {
                self.flush();
                self.dump(worker, result);
            }
            Inbound::Heartbeat(registration, source) => {
                self.flush();
                self.heartbeat(registration, source);
            }
            Inbound::Leave(worker) => {
                self.flush();
                if let Some(track) = self.tracks.remove(&worker) {
                    self.state.forget(track.kv_id);
                }
                if self.pool.remove(&worker).is_some() {
                    tracing::info!(%worker, "worker left");
                }
            }
            Inbound::Lost(worker) => {
                self.flush();
                let Some(track) = self.tracks.get_mut(&worker) else {
                    if let Some(found) = self.pool.by_name(&worker) {
                        self.state.forget(found.kv_id);
                    }
                    return;
                };
                self.state.forget(track.kv_id);
                if track.source.answers_dumps() {
                    // Its blocks come back from a dump once it answers again.
                    track.resync.get_or_insert_with(new_resync);
                }
            }
            Inbound::Active(update) => {
                let worker = self.pool.by_name(&update.worker).map(|w| w.kv_id);
                self.state.apply_remote_active(&update, worker);
            }
        }
    }

    fn ignored(&self, reason: &'static str) {
        self.state
            .metrics
            .events_ignored
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc();
    }

    fn track(&mut self, worker: &str, source: &Arc<dyn DumpSource>) -> Option<&mut Track> {
        if !self.tracks.contains_key(worker) {
            let found = self.pool.by_name(worker)?;
            // Encoders announce cached media as one-block sequences; only LLM workers' blocks
            // must agree with their model's block size.
            let indexable =
                !found.role.is_llm() || self.state.check_block_size(&found.name, &found.model, found.block_size);
            self.tracks.insert(
                worker.to_string(),
                Track {
                    kv_id: found.kv_id,
                    last_event_id: 0,
                    source: source.clone(),
                    indexable,
                    resync: None,
                    heartbeat: None,
                    tail_suspect: None,
                },
            );
        }
        self.tracks.get_mut(worker)
    }

    fn event(&mut self, event: WorkerEvent, source: &Arc<dyn DumpSource>) {
        let resync_buffer = self.config.resync_buffer;
        let Some(track) = self.track(&event.worker, source) else {
            self.ignored("unknown_worker");
            return;
        };
        if !track.indexable {
            self.ignored("block_size_mismatch");
            return;
        }
        if let Some(resync) = &mut track.resync {
            if resync.buffer.len() >= resync_buffer {
                resync.buffer.clear();
                resync.overflowed = true;
            } else {
                resync.buffer.push(event);
            }
            return;
        }
        let kv_id = track.kv_id;
        let expected = track.last_event_id + 1;
        if event.event_id == 1 && track.last_event_id >= 1 {
            // The worker restarted: its old cache is gone.
            tracing::info!(worker = %event.worker, "worker restarted its event stream; dropping its old blocks");
            track.last_event_id = 1;
            self.batch
                .push((event.worker.clone(), kv_id, StorageTier::Device, KvEvent::Cleared));
            self.batch.push((event.worker, kv_id, event.tier, event.event));
            return;
        }
        if event.event_id < expected {
            self.ignored("duplicate");
            return;
        }
        if event.event_id > expected {
            let dumps = track.source.answers_dumps();
            if dumps {
                let mut resync = new_resync();
                resync.buffer.push(event.clone());
                track.resync = Some(resync);
            } else {
                track.last_event_id = event.event_id;
            }
            let name = event.worker.clone();
            self.state
                .metrics
                .gaps
                .get_or_create(&vec![("worker", name.clone())])
                .inc();
            tracing::warn!(worker = %name, expected, got = event.event_id, "gap in KV events; resyncing");
            if dumps {
                self.request_dump(&name);
            } else {
                self.count_resync(&name, "cleared");
                self.batch
                    .push((name.clone(), kv_id, StorageTier::Device, KvEvent::Cleared));
                self.batch.push((name, kv_id, event.tier, event.event));
            }
            return;
        }
        track.last_event_id = event.event_id;
        self.batch.push((event.worker, kv_id, event.tier, event.event));
        if self.batch.len() >= MAX_BATCH {
            self.flush();
        }
    }

    fn count_resync(&self, worker: &str, outcome: &'static str) {
        self.state
            .metrics
            .resyncs
            .get_or_create(&vec![("worker", worker.to_string()), ("outcome", outcome.to_string())])
            .inc();
    }

    /// Applies the pending events.
    fn flush(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let mut applied: HashMap<&str, u64> = HashMap::new();
        let mut mismatched: Vec<&str> = Vec::new();
        {
            let index = self.state.index();
            for (worker, kv_id, tier, event) in &self.batch {
                if index.apply(*kv_id, *tier, event) == Some(Anomaly::HashMismatch) {
                    mismatched.push(worker);
                }
                *applied.entry(worker).or_default() += 1;
            }
        }
        for (worker, count) in applied {
            self.state
                .metrics
                .events_applied
                .get_or_create(&vec![("worker", worker.to_string())])
                .inc_by(count);
        }
        for worker in mismatched {
            let counter = self
                .state
                .metrics
                .hash_mismatches
                .get_or_create(&vec![("worker", worker.to_string())]);
            if counter.inc() == 0 {
                tracing::error!(%worker, "stored blocks do not chain under Switchyard's hashing (tokenizer, template or seed differ): overlap with this worker will be zero");
            }
        }
        self.batch.clear();
        self.state.refresh_size();
    }

    fn request_dump(&mut self, worker: &str) {
        let Some(track) = self.tracks.get_mut(worker) else {
            return;
        };
        let Some(resync) = &mut track.resync else {
            return;
        };
        if resync.in_flight {
            return;
        }
        resync.in_flight = true;
        resync.last_request = Some(Instant::now());
        let future = track.source.request(worker.to_string());
        let timeout = self.config.resync_timeout;
        let sender = self.sender.clone();
        let worker = worker.to_string();
        tokio::spawn(async move {
            let result = match tokio::time::timeout(timeout, future).await {
                Ok(result) => result,
                Err(_) => Err(format!("no dump within {} ms", timeout.as_millis())),
            };
            let _ = sender.send(Inbound::Dump { worker, result });
        });
    }

    fn dump(&mut self, worker: String, result: Result<KvDump, String>) {
        let Some(track) = self.tracks.get_mut(&worker) else {
            return;
        };
        let Some(resync) = track.resync.as_mut() else {
            return;
        };
        resync.in_flight = false;
        let dump = match result {
            Ok(dump) => dump,
            Err(reason) => {
                tracing::warn!(%worker, %reason, "resync failed; will retry");
                self.count_resync(&worker, "failed");
                return;
            }
        };
        let Some(resync) = track.resync.take() else {
            return;
        };
        let anomaly = self.state.index().load_dump(track.kv_id, &dump.blocks);
        track.last_event_id = dump.last_event_id;
        let source = track.source.clone();
        tracing::info!(%worker, blocks = dump.blocks.len(), last_event_id = dump.last_event_id, "resynced from dump");
        self.count_resync(&worker, "ok");
        if anomaly == Some(Anomaly::HashMismatch) {
            self.state
                .metrics
                .hash_mismatches
                .get_or_create(&vec![("worker", worker.clone())])
                .inc();
        }
        if resync.overflowed {
            // Events after the dump were dropped: another round.
            if let Some(track) = self.tracks.get_mut(&worker) {
                track.resync = Some(new_resync());
            }
            self.request_dump(&worker);
        } else {
            self.replay_after_dump(&worker, resync.buffer, &source);
        }
        self.state.refresh_size();
    }

    /// Applies the events buffered during a resync on top of the dump just loaded.
    ///
    /// A buffered event still ahead of the dump by more than one cannot follow it: the dump
    /// was taken after the event arrived, so an honest worker's dump would already cover it
    /// (the event is forged, or from an earlier run). Treating it as a fresh gap would ask
    /// for the same dump again and replay the same event, forever, and every reload empties
    /// the worker's blocks for a moment; so it is dropped, and a real loss still shows at the
    /// next live event.
    fn replay_after_dump(&mut self, worker: &str, buffer: Vec<WorkerEvent>, source: &Arc<dyn DumpSource>) {
        for event in buffer {
            let next = self.tracks.get(worker).map_or(0, |track| track.last_event_id + 1);
            if event.event_id > next && event.event_id != 1 {
                self.ignored("ahead_of_dump");
                tracing::warn!(%worker, expected = next, got = event.event_id, "an event the worker's own dump does not reach was dropped");
                continue;
            }
            self.event(event, source);
        }
    }

    fn heartbeat(&mut self, registration: Registration, source: Arc<dyn DumpSource>) {
        let name = registration.worker.clone();
        let role = registration.role;
        if !valid_worker_name(&name)
            || registration.block_size == 0
            || !registration.url.starts_with("http://")
            || registration.heartbeat_ms == 0
        {
            tracing::warn!(worker = %name, url = %registration.url, "invalid registration ignored");
            self.ignored("bad_registration");
            return;
        }
        let config = WorkerConfig {
            name: Some(name.clone()),
            url: registration.url.clone(),
            model: registration.model.clone(),
            role,
            block_size: registration.block_size,
            capabilities: registration.capabilities.clone(),
            cost: registration.cost,
            capacity_blocks: registration.capacity_blocks,
            node: registration.node.clone(),
            token_budgets: registration.token_budgets.clone(),
            spot: registration.spot,
            // Only Switchyard's workers register themselves.
            engine: Some(crate::config::EngineKind::Switchyard),
            health_path: None,
        };
        let (worker, fresh) = match self.pool.upsert(&config) {
            Ok(upserted) => upserted,
            Err(err) => {
                tracing::warn!(worker = %name, error = %err, "registration with a bad URL ignored");
                self.ignored("bad_registration");
                return;
            }
        };
        if registration.preempting {
            self.pool.preempt(&worker);
        }
        let now = Instant::now();
        let interval = Duration::from_millis(registration.heartbeat_ms);
        let stale = self.tracks.get(&name).is_some_and(|t| t.kv_id != worker.kv_id);
        if fresh || stale || !self.tracks.contains_key(&name) {
            if let Some(old) = self.tracks.remove(&name)
                && old.kv_id != worker.kv_id
            {
                self.state.forget(old.kv_id);
            }
            if fresh {
                tracing::info!(worker = %name, url = %registration.url, model = %registration.model, "worker registered");
            }
            let indexable = !worker.role.is_llm()
                || self
                    .state
                    .check_block_size(&worker.name, &worker.model, worker.block_size);
            self.tracks.insert(
                name.clone(),
                Track {
                    kv_id: worker.kv_id,
                    last_event_id: 0,
                    source,
                    indexable,
                    resync: (registration.last_event_id > 0 && indexable).then(new_resync),
                    heartbeat: Some((interval, now)),
                    tail_suspect: None,
                },
            );
            self.request_dump(&name);
            return;
        }
        let Some(track) = self.tracks.get_mut(&name) else {
            return;
        };
        track.heartbeat = Some((interval, now));
        if track.resync.is_some() || !track.indexable {
            return;
        }
        if registration.last_event_id > track.last_event_id {
            // Seen twice in a row, the tail of the stream was lost (once may be a race).
            if track.tail_suspect == Some(registration.last_event_id) {
                self.state
                    .metrics
                    .gaps
                    .get_or_create(&vec![("worker", name.clone())])
                    .inc();
                tracing::warn!(worker = %name, "KV events lost at the tail of the stream; resyncing");
                track.resync = Some(new_resync());
                track.tail_suspect = None;
                self.request_dump(&name);
            } else {
                track.tail_suspect = Some(registration.last_event_id);
            }
        } else {
            track.tail_suspect = None;
        }
    }

    fn tick(&mut self) {
        self.flush();
        let now = Instant::now();
        let misses = self.config.heartbeat_misses;
        let expired: Vec<String> = self
            .tracks
            .iter()
            .filter(|(_, t)| {
                t.heartbeat
                    .is_some_and(|(interval, seen)| now.duration_since(seen) > interval * misses)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in expired {
            if let Some(track) = self.tracks.remove(&name) {
                self.state.forget(track.kv_id);
            }
            if self.pool.remove(&name).is_some() {
                self.state.metrics.workers_expired.inc();
                tracing::warn!(worker = %name, "worker missed its heartbeats: out of the pool and the index");
            }
        }
        let retry: Vec<String> = self
            .tracks
            .iter()
            .filter(|(_, t)| {
                t.resync.as_ref().is_some_and(|r| {
                    !r.in_flight && r.last_request.is_none_or(|at| now.duration_since(at) >= RESYNC_BACKOFF)
                })
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in retry {
            self.request_dump(&name);
        }
    }
}

fn new_resync() -> Resync {
    Resync {
        buffer: Vec::new(),
        overflowed: false,
        in_flight: false,
        last_request: None,
    }
}

#[cfg(test)]
#[path = "applier_tests.rs"]
mod tests;
