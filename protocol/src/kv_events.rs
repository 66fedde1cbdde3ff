//! The KV event protocol between workers and gateways.
//!
//! This module owns what a worker tells the routing layer about its prefix cache and itself:
//! the events ([`KvEvent`]: `stored`, `removed`, `cleared`), numbered per worker by a monotonic
//! `event_id` ([`WorkerEvent`]) so that a gateway notices a lost event; the snapshot a worker
//! answers a resync with ([`KvDump`]); and the announcement it repeats as a heartbeat
//! ([`Registration`]). [`EventLog`] is the worker-side bookkeeping that numbers events and keeps
//! the mirror a dump is taken from. Transports carry these values as JSON: the in-process bus
//! of the embedded default passes them as they are, and NATS uses the subjects of [`Subjects`].
//!
//! Block hashes follow [`crate::block_hash`]: in a `stored` event, `block_hash` is the block's
//! *sequence* hash and `tokens_hash` its *local* hash, so any gateway can check the chain.
//! Engines that name blocks otherwise (vLLM) are translated by an adapter before they reach
//! the index.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// One block of a `stored` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The block's sequence hash (what the engine names it by).
    pub block_hash: u64,
    /// The hash of the block's own tokens (its local hash).
    pub tokens_hash: u64,
}

/// A change to the set of blocks a worker holds in its prefix cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEvent {
    /// Blocks became cached, chained after `parent` (`None`: at the start of a sequence).
    Stored {
        /// The sequence hash of the block before the first stored one.
        parent: Option<u64>,
        /// The stored blocks, in sequence order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks were evicted.
    Removed {
        /// Sequence hashes of the evicted blocks.
        block_hashes: Vec<u64>,
    },
    /// Every cached block was dropped.
    Cleared,
}

/// Where a cached block lives on its worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageTier {
    /// GPU memory: reusable at once.
    #[default]
    Device,
    /// Host memory: reusable after a copy back to the GPU.
    Host,
}

/// A [`KvEvent`] from a named worker, numbered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerEvent {
    /// The worker's name (as it registered).
    pub worker: String,
    /// Monotonic per worker, starting at 1; a jump means events were lost.
    pub event_id: u64,
    /// The tier the event is about.
    #[serde(default)]
    pub tier: StorageTier,
    /// What changed.
    pub event: KvEvent,
}

/// One cached block in a [`KvDump`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DumpBlock {
    /// The block's sequence hash.
    pub block_hash: u64,
    /// The sequence hash of the block before it, if any.
    pub parent: Option<u64>,
    /// The block's local hash.
    pub tokens_hash: u64,
    /// Where it lives.
    #[serde(default)]
    pub tier: StorageTier,
}

/// A worker's whole prefix cache, as of `last_event_id`: the answer to a resync request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvDump {
    /// The worker.
    pub worker: String,
    /// The id of the last event reflected in `blocks`; events after it follow the dump.
    pub last_event_id: u64,
    /// Every cached block, each after its parent when the parent is cached too.
    pub blocks: Vec<DumpBlock>,
}

/// What a worker announces about itself, repeated as its heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// Unique name: a NATS subject token (no `.`, `*`, `>` or whitespace).
    pub worker: String,
    /// Base URL of its OpenAI API.
    pub url: String,
    /// The model it serves.
    pub model: String,
    /// What it does (`llm`, `vision` or `audio` on the wire).
    pub role: crate::Role,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Total KV blocks on the device.
    pub capacity_blocks: u64,
    /// Capabilities (`text`, `image`, `audio`, `video`).
    pub capabilities: Vec<String>,
    /// Relative cost of a token (spot < reserved).
    pub cost: f64,
    /// The machine it runs on (encoder and LLM worker on the same node exchange features
    /// faster); empty: unknown.
    #[serde(default)]
    pub node: String,
    /// Encoders: the token budgets it batches to (its captured CUDA-graph sizes), ascending.
    #[serde(default)]
    pub token_budgets: Vec<u32>,
    /// Spot (preemptible) capacity: it may be taken away at any moment.
    #[serde(default)]
    pub spot: bool,
    /// It has been told it will be preempted (a spot reclaim notice): gateways take it out of
    /// routing at once and let its in-flight requests finish while it lasts.
    #[serde(default)]
    pub preempting: bool,
    /// How often it heartbeats; a gateway drops it after a few missed beats.
    pub heartbeat_ms: u64,
    /// Its newest event id, so a gateway can tell it missed the tail of the stream.
    pub last_event_id: u64,
}

/// Whether `name` can be a worker name: non-empty, at most 128 bytes of ASCII letters, digits,
/// `-` and `_` (it is used as a NATS subject token and a metric label).
pub fn valid_worker_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// NATS subjects, all under one configurable prefix (default `switchyard`).
///
/// | subject | payload | from → to |
/// |---|---|---|
/// | `P.kv.events.W` | [`WorkerEvent`] | worker `W` → gateways |
/// | `P.kv.dump.W` (request/reply) | empty → [`KvDump`] | gateway → worker `W` |
/// | `P.workers.heartbeat` | [`Registration`] | workers → gateways |
/// | `P.workers.leave` | the worker name | workers → gateways |
/// | `P.active` | active-sequence updates | gateway ↔ gateways |
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl Subjects {
    /// Subjects under `prefix`.
    pub fn new(prefix: impl Into<String>) -> Subjects {
        Subjects { prefix: prefix.into() }
    }

    /// Where worker `worker` publishes its events.
    pub fn events(&self, worker: &str) -> String {
        format!("{}.kv.events.{worker}", self.prefix)
    }

    /// The wildcard that receives every worker's events.
    pub fn all_events(&self) -> String {
        format!("{}.kv.events.*", self.prefix)
    }

    /// Where worker `worker` answers dump requests.
    pub fn dump(&self, worker: &str) -> String {
        format!("{}.kv.dump.{worker}", self.prefix)
    }

    /// Where workers heartbeat.
    pub fn heartbeat(&self) -> String {
        format!("{}.workers.heartbeat", self.prefix)
    }

    /// Where workers say goodbye.
    pub fn leave(&self) -> String {
        format!("{}.workers.leave", self.prefix)
    }

    /// Where gateway replicas share active sequences.
    pub fn active(&self) -> String {
        format!("{}.active", self.prefix)
    }
}

impl Default for Subjects {
    fn default() -> Subjects {
        Subjects::new("switchyard")
    }
}

/// Worker-side event bookkeeping: numbers events and mirrors the cached blocks so that a dump
/// can be answered at any time without asking the engine.
#[derive(Debug)]
pub struct EventLog {
    worker: String,
    last_event_id: u64,
    blocks: HashMap<u64, (Option<u64>, u64)>,
}

impl EventLog {
    /// An empty log for `worker`.
    pub fn new(worker: impl Into<String>) -> EventLog {
        EventLog {
            worker: worker.into(),
            last_event_id: 0,
            blocks: HashMap::new(),
        }
    }

    /// The worker's name.
    pub fn worker(&self) -> &str {
        &self.worker
    }

    /// The id of the newest event.
    pub fn last_event_id(&self) -> u64 {
        self.last_event_id
    }

    /// Cached blocks in the mirror.
    pub fn cached_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Numbers `event`, updates the mirror, and returns the event to publish.
    pub fn record(&mut self, event: KvEvent) -> WorkerEvent {
        match &event {
            KvEvent::Stored { parent, blocks } => {
                let mut parent = *parent;
                for block in blocks {
                    self.blocks.insert(block.block_hash, (parent, block.tokens_hash));
                    parent = Some(block.block_hash);
                }
            }
            KvEvent::Removed { block_hashes } => {
                for hash in block_hashes {
                    self.blocks.remove(hash);
                }
            }
            KvEvent::Cleared => self.blocks.clear(),
        }
        self.last_event_id += 1;
        WorkerEvent {
            worker: self.worker.clone(),
            event_id: self.last_event_id,
            tier: StorageTier::Device,
            event,
        }
    }

    /// The whole mirror as a dump, parents before children.
    pub fn dump(&self) -> KvDump {
        let mut depth: HashMap<u64, usize> = HashMap::with_capacity(self.blocks.len());
        for &hash in self.blocks.keys() {
            // Walk up to the first ancestor of known depth (or the root), then fill downwards.
            let mut chain = vec![hash];
            let mut base = 0;
            while let Some(&current) = chain.last() {
                if let Some(&known) = depth.get(&current) {
                    chain.pop();
                    base = known + 1;
                    break;
                }
                match self.blocks.get(&current).and_then(|(parent, _)| *parent) {
                    Some(parent) if self.blocks.contains_key(&parent) && chain.len() <= self.blocks.len() => {
                        chain.push(parent);
                    }
                    _ => break,
                }
            }
            for (offset, hash) in chain.iter().rev().enumerate() {
                depth.insert(*hash, base + offset);
            }
        }
        let mut blocks: Vec<DumpBlock> = self
            .blocks
            .iter()
            .map(|(&block_hash, &(parent, tokens_hash))| DumpBlock {
                block_hash,
                parent,
                tokens_hash,
                tier: StorageTier::Device,
            })
            .collect();
        blocks.sort_by_key(|block| (depth.get(&block.block_hash).copied().unwrap_or(0), block.block_hash));
        KvDump {
            worker: self.worker.clone(),
            last_event_id: self.last_event_id,
            blocks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(parent: Option<u64>, hashes: &[u64]) -> KvEvent {
        KvEvent::Stored {
            parent,
            blocks: hashes
                .iter()
                .map(|&h| StoredBlock {
                    block_hash: h,
                    tokens_hash: h + 1000,
                })
                .collect(),
        }
    }

    #[test]
    fn events_are_numbered_from_one() {
        let mut log = EventLog::new("w");
        assert_eq!(log.record(stored(None, &[1])).event_id, 1);
        assert_eq!(log.record(KvEvent::Cleared).event_id, 2);
        assert_eq!(log.last_event_id(), 2);
        assert_eq!(log.cached_blocks(), 0);
    }

    #[test]
    fn dump_lists_parents_before_children() {
        let mut log = EventLog::new("w");
        log.record(stored(None, &[1, 2]));
        log.record(stored(Some(2), &[3, 4]));
        log.record(stored(Some(1), &[5]));
        log.record(KvEvent::Removed { block_hashes: vec![4] });
        let dump = log.dump();
        assert_eq!(dump.last_event_id, 4);
        let order: Vec<u64> = dump.blocks.iter().map(|b| b.block_hash).collect();
        let position = |h: u64| order.iter().position(|&x| x == h).expect("present");
        assert_eq!(order.len(), 4);
        assert!(position(1) < position(2) && position(2) < position(3) && position(1) < position(5));
        assert_eq!(dump.blocks[position(3)].parent, Some(2));
        assert_eq!(dump.blocks[position(3)].tokens_hash, 1003);
    }

    #[test]
    fn events_round_trip_as_json() {
        let event = WorkerEvent {
            worker: "w".into(),
            event_id: 7,
            tier: StorageTier::Host,
            event: stored(Some(9), &[1]),
        };
        let text = serde_json::to_string(&event).expect("serializes");
        assert!(text.contains(r#""type":"stored""#), "{text}");
        assert_eq!(serde_json::from_str::<WorkerEvent>(&text).expect("parses"), event);
    }

    #[test]
    fn worker_names_must_be_subject_tokens() {
        assert!(valid_worker_name("gpu-3_a"));
        assert!(!valid_worker_name("a.b"));
        assert!(!valid_worker_name("a*"));
        assert!(!valid_worker_name(""));
        assert!(!valid_worker_name("a b"));
    }
}
