//! The active-sequence tracker: the load each worker carries from requests routed to it.
//!
//! Per worker it counts the KV blocks held by active requests (ref-counted, so requests that
//! share a prefix count its blocks once), the prompt tokens still to be prefilled (dropped when
//! the first token comes back), and the active requests. The gateway updates it itself at
//! route, first token and end, so no worker event is needed; replicas may share their updates
//! (`crate::events::applier`), and each request is keyed by `(origin gateway, request id)` so that
//! entries from several gateways never collide. Entries from other gateways expire after a
//! while in case their `free` is lost with their gateway.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::kv::index::{HashKeyed, WorkerId};

/// A request's key: the gateway that routed it and its id there.
pub type RequestKey = (u64, u64);

/// The load on one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Load {
    /// Distinct KV blocks held by active requests.
    pub active_blocks: u32,
    /// Prompt tokens routed whose first token has not come back.
    pub prefill_tokens: u64,
    /// Active requests.
    pub requests: u32,
}

#[derive(Debug, Default)]
struct WorkerLoad {
    blocks: HashKeyed<u32>,
    prefill_tokens: u64,
    requests: u32,
}

#[derive(Debug)]
struct Entry {
    worker: WorkerId,
    hashes: Vec<u64>,
    prefill_tokens: u64,
    started: Instant,
}

/// The tracker (not synchronised; `crate::kv::KvState` holds it under a mutex).
#[derive(Debug)]
pub struct ActiveSequences {
    origin: u64,
    remote_ttl: Duration,
    workers: HashMap<WorkerId, WorkerLoad>,
    requests: HashMap<RequestKey, Entry>,
    last_sweep: Instant,
}

impl ActiveSequences {
    /// A tracker for the gateway `origin`; other gateways' entries live at most `remote_ttl`.
    pub fn new(origin: u64, remote_ttl: Duration) -> ActiveSequences {
        ActiveSequences {
            origin,
            remote_ttl,
            workers: HashMap::new(),
            requests: HashMap::new(),
            last_sweep: Instant::now(),
        }
    }

    /// Records a request routed to `worker` with the prompt's block `hashes` and
    /// `prefill_tokens` still to compute. A key already present is left as it is.
    pub fn add(&mut self, key: RequestKey, worker: WorkerId, hashes: Vec<u64>, prefill_tokens: u64) {
        self.sweep();
        if self.requests.contains_key(&key) {
            return;
        }
        let load = self.workers.entry(worker).or_default();
        for &hash in &hashes {
            *load.blocks.entry(hash).or_insert(0) += 1;
        }
        load.prefill_tokens += prefill_tokens;
        load.requests += 1;
        self.requests.insert(
            key,
            Entry {
                worker,
                hashes,
                prefill_tokens,
                started: Instant::now(),
            },
        );
    }

    /// The request's first token came back: its prompt is no longer prefill work.
    pub fn prefill_done(&mut self, key: RequestKey) {
        let Some(entry) = self.requests.get_mut(&key) else {
            return;
        };
        if let Some(load) = self.workers.get_mut(&entry.worker) {
            load.prefill_tokens = load.prefill_tokens.saturating_sub(entry.prefill_tokens);
        }
        entry.prefill_tokens = 0;
    }

    /// The request ended.
    pub fn free(&mut self, key: RequestKey) {
        let Some(entry) = self.requests.remove(&key) else {
            return;
        };
        self.release(entry);
    }

    fn release(&mut self, entry: Entry) {
        let Some(load) = self.workers.get_mut(&entry.worker) else {
            return;
        };
        load.prefill_tokens = load.prefill_tokens.saturating_sub(entry.prefill_tokens);
        load.requests = load.requests.saturating_sub(1);
        for hash in entry.hashes {
            if let Some(count) = load.blocks.get_mut(&hash) {
                *count -= 1;
                if *count == 0 {
                    load.blocks.remove(&hash);
                }
            }
        }
        if load.requests == 0 {
            self.workers.remove(&entry.worker);
        }
    }

    /// Forgets a worker and every request on it.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
        self.requests.retain(|_, entry| entry.worker != worker);
    }

    /// The load on `worker`.
    pub fn load(&self, worker: WorkerId) -> Load {
        self.workers.get(&worker).map_or(Load::default(), |load| Load {
            active_blocks: u32::try_from(load.blocks.len()).unwrap_or(u32::MAX),
            prefill_tokens: load.prefill_tokens,
            requests: load.requests,
        })
    }

    /// Active requests in total.
    pub fn requests(&self) -> usize {
        self.requests.len()
    }

    fn sweep(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < self.remote_ttl / 4 {
            return;
        }
        self.last_sweep = now;
        let origin = self.origin;
        let ttl = self.remote_ttl;
        let expired: Vec<RequestKey> = self
            .requests
            .iter()
            .filter(|(key, entry)| key.0 != origin && now.duration_since(entry.started) > ttl)
            .map(|(key, _)| *key)
            .collect();
        for key in expired {
            if let Some(entry) = self.requests.remove(&key) {
                self.release(entry);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_blocks_are_counted_once() {
        let mut active = ActiveSequences::new(1, Duration::from_secs(60));
        active.add((1, 1), 5, vec![10, 11, 12], 300);
        active.add((1, 2), 5, vec![10, 11, 13], 100);
        assert_eq!(
            active.load(5),
            Load {
                active_blocks: 4,
                prefill_tokens: 400,
                requests: 2
            }
        );
        active.prefill_done((1, 1));
        assert_eq!(active.load(5).prefill_tokens, 100);
        active.free((1, 1));
        assert_eq!(
            active.load(5),
            Load {
                active_blocks: 3,
                prefill_tokens: 100,
                requests: 1
            }
        );
        active.free((1, 2));
        active.free((1, 2));
        assert_eq!(active.load(5), Load::default());
        assert_eq!(active.requests(), 0);
    }

    #[test]
    fn removed_workers_carry_no_load() {
        let mut active = ActiveSequences::new(1, Duration::from_secs(60));
        active.add((1, 1), 5, vec![10], 64);
        active.remove_worker(5);
        assert_eq!(active.load(5), Load::default());
        active.free((1, 1));
        assert_eq!(active.load(5), Load::default());
    }

    #[test]
    fn other_gateways_entries_expire() {
        let mut active = ActiveSequences::new(1, Duration::from_millis(20));
        active.add((2, 1), 5, vec![10], 64);
        active.add((1, 1), 6, vec![10], 64);
        std::thread::sleep(Duration::from_millis(30));
        active.add((1, 2), 6, vec![11], 64);
        assert_eq!(active.load(5), Load::default(), "the remote entry expired");
        assert_eq!(active.load(6).requests, 2, "local entries never expire");
    }
}
