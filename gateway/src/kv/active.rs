//! The active-sequence tracker: the load each worker carries from requests routed to it.
//!
//! Per worker it counts the KV blocks held by active requests (ref-counted, so requests that
//! share a prefix count its blocks once), the prompt tokens still to be prefilled (dropped when
//! the first token comes back), and the active requests. The gateway updates it itself at
//! route, first token and end, so no worker event is needed; replicas may share their updates
//! (`crate::events::applier`), and each request is keyed by `(origin gateway, request id)` so that
//! entries from several gateways never collide. Entries from other gateways expire after a
//! while in case their `free` is lost with their gateway.
//!
//! [`ShardedActive`] is what the gateway uses: the tracker split by worker into shards under
//! locks of their own, so that one request's per-block work (counting its prompt's blocks on
//! its worker, and uncounting them at the end) never holds a lock that requests on other
//! shards need. The one structure every request touches is a map from request to shard, with
//! O(1) work under its lock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

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

/// The tracker of one shard (not synchronised; [`ShardedActive`] holds each under its lock).
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
    /// `prefill_tokens` still to compute. A key already present is left as it is. Returns the
    /// keys of other gateways' entries that expired meanwhile (usually none), and the prefill
    /// tokens the worker had pending before this request (0 for a key already present).
    pub fn add(
        &mut self,
        key: RequestKey,
        worker: WorkerId,
        hashes: Vec<u64>,
        prefill_tokens: u64,
    ) -> (Vec<RequestKey>, u64) {
        let expired = self.sweep();
        if self.requests.contains_key(&key) {
            return (expired, 0);
        }
        let load = self.workers.entry(worker).or_default();
        let ahead = load.prefill_tokens;
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
        (expired, ahead)
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

    /// Forgets a worker and every request on it; returns those requests' keys.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Vec<RequestKey> {
        self.workers.remove(&worker);
        let gone: Vec<RequestKey> = self
            .requests
            .iter()
            .filter(|(_, entry)| entry.worker == worker)
            .map(|(key, _)| *key)
            .collect();
        for key in &gone {
            self.requests.remove(key);
        }
        gone
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
    #[cfg(test)]
    pub fn requests(&self) -> usize {
        self.requests.len()
    }

    fn sweep(&mut self) -> Vec<RequestKey> {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < self.remote_ttl / 4 {
            return Vec::new();
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
        for key in &expired {
            if let Some(entry) = self.requests.remove(key) {
                self.release(entry);
            }
        }
        expired
    }
}

/// The tracker, sharded by worker (see the module documentation).
#[derive(Debug)]
pub struct ShardedActive {
    shards: Box<[Mutex<ActiveSequences>]>,
    /// Which shard holds each request.
    owners: Mutex<HashMap<RequestKey, usize>>,
}

impl ShardedActive {
    /// A tracker of `shards` shards (at least one) for the gateway `origin`.
    pub fn new(origin: u64, remote_ttl: Duration, shards: usize) -> ShardedActive {
        ShardedActive {
            shards: (0..shards.max(1))
                .map(|_| Mutex::new(ActiveSequences::new(origin, remote_ttl)))
                .collect(),
            owners: Mutex::new(HashMap::new()),
        }
    }

    fn shard_of(&self, worker: WorkerId) -> usize {
        worker as usize % self.shards.len()
    }

    /// As [`ActiveSequences::add`]; answers the prefill tokens the worker had pending before
    /// this request (0 for a key already present).
    pub fn add(&self, key: RequestKey, worker: WorkerId, hashes: Vec<u64>, prefill_tokens: u64) -> u64 {
        let shard = self.shard_of(worker);
        {
            let mut owners = self.owners.lock();
            if owners.contains_key(&key) {
                return 0;
            }
            owners.insert(key, shard);
        }
        let (expired, ahead) = self.shards[shard].lock().add(key, worker, hashes, prefill_tokens);
        if !expired.is_empty() {
            let mut owners = self.owners.lock();
            for key in expired {
                owners.remove(&key);
            }
        }
        ahead
    }

    /// As [`ActiveSequences::prefill_done`].
    pub fn prefill_done(&self, key: RequestKey) {
        let shard = self.owners.lock().get(&key).copied();
        if let Some(shard) = shard {
            self.shards[shard].lock().prefill_done(key);
        }
    }

    /// As [`ActiveSequences::free`].
    pub fn free(&self, key: RequestKey) {
        let shard = self.owners.lock().remove(&key);
        if let Some(shard) = shard {
            self.shards[shard].lock().free(key);
        }
    }

    /// As [`ActiveSequences::remove_worker`].
    pub fn remove_worker(&self, worker: WorkerId) {
        let gone = self.shards[self.shard_of(worker)].lock().remove_worker(worker);
        let mut owners = self.owners.lock();
        for key in gone {
            owners.remove(&key);
        }
    }

    /// The load on `worker`.
    pub fn load(&self, worker: WorkerId) -> Load {
        self.shards[self.shard_of(worker)].lock().load(worker)
    }

    /// The loads of `workers`, in order, each shard locked once.
    pub fn loads(&self, workers: &[WorkerId]) -> Vec<Load> {
        let mut out = vec![Load::default(); workers.len()];
        for (index, shard) in self.shards.iter().enumerate() {
            let mut members = workers
                .iter()
                .enumerate()
                .filter(|(_, worker)| self.shard_of(**worker) == index)
                .peekable();
            if members.peek().is_none() {
                continue;
            }
            let shard = shard.lock();
            for (slot, &worker) in members {
                out[slot] = shard.load(worker);
            }
        }
        out
    }

    /// Active requests in total.
    pub fn requests(&self) -> usize {
        self.owners.lock().len()
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
    fn the_sharded_tracker_answers_as_one() {
        let sharded = ShardedActive::new(1, Duration::from_secs(60), 4);
        let mut single = ActiveSequences::new(1, Duration::from_secs(60));
        let ops: [(RequestKey, WorkerId, Vec<u64>, u64); 5] = [
            ((1, 1), 5, vec![10, 11, 12], 300),
            ((1, 2), 5, vec![10, 11, 13], 100),
            ((1, 3), 6, vec![10], 64),
            ((2, 1), 7, vec![20, 21], 128),
            ((1, 4), 9, vec![30], 64),
        ];
        for (key, worker, hashes, prefill) in ops {
            sharded.add(key, worker, hashes.clone(), prefill);
            single.add(key, worker, hashes, prefill);
        }
        let workers = [5, 6, 7, 8, 9];
        let expected: Vec<Load> = workers.iter().map(|&w| single.load(w)).collect();
        assert_eq!(sharded.loads(&workers), expected);
        sharded.prefill_done((1, 1));
        single.prefill_done((1, 1));
        sharded.free((1, 2));
        single.free((1, 2));
        sharded.remove_worker(7);
        single.remove_worker(7);
        let expected: Vec<Load> = workers.iter().map(|&w| single.load(w)).collect();
        assert_eq!(sharded.loads(&workers), expected);
        assert_eq!(sharded.requests(), single.requests());
        assert_eq!(sharded.load(5), single.load(5));
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
