//! The prefix index: which worker holds which cached block, and per-worker prefix overlap.
//!
//! A radix tree over blocks in which a node's identity is its whole path: nodes are keyed by
//! the block's *sequence* hash, which already chains every block before it (see
//! `switchyard_protocol::block_hash`), so the tree is stored flat in hash maps and a child is
//! found from its parent by the request's next sequence hash, with no per-node child map. Each
//! node holds a sorted list of holders, `worker << 1 | tier` (tier 0 device, 1 host), mostly
//! inline. A lookup walks the request's sequence hashes from the root, carrying the workers
//! still matching; a worker's device overlap is the run of leading blocks it holds on device,
//! its host overlap the run that continues from there on host (or device).
//!
//! Concurrency: the index is shared by `&self`. Nodes live in [`SHARDS`] tables, each behind
//! its own lock, and every operation takes one table's lock for one block: a lookup reads one
//! node at a time, an event writes one block at a time, so a lookup waits at most for one
//! block's insert or removal (or one table's rehash, 1/4096 of the index), never for a batch of
//! events (the `kv_index` bench measures the lookup tail with a writer running: 256 tables left
//! a p999 of ~65 µs, 4096 ~35 µs, one lock held per 256-event batch ~1 ms). A lookup that runs
//! while an event is being applied sees it partly applied, which is no staler than the workers'
//! caches it mirrors. Counts sit behind a mutex taken once per event.
//!
//! Speed: a fleet's nodes do not fit in the CPU's caches, so each block costs a cache miss, and
//! a lock per block keeps the CPU from overlapping them. So the tables are our own
//! ([`super::table`]: one 16-byte slot per node, found at an address its hash gives), and while
//! an event or a lookup works on one block it prefetches the slots of the blocks [`AHEAD`] of it.
//!
//! Memory is bounded by what workers hold: a node is freed when its last holder leaves. Each
//! holding is stored once, in its node (most nodes have one holder, kept inline); dropping a
//! whole worker (it left, or sent `cleared`) is rare, so it scans the tables instead of keeping
//! a second per-worker copy of every holding.
//!
//! Block hashes come from prompts, and the hashing is public (xxh3 with a fixed seed), so a
//! client could craft prompts whose hashes share low bits and pile them into one bucket chain.
//! Tables and shards are therefore picked by a keyed hash (foldhash) of the block hash, seeded
//! per process from the OS's randomness ([`KeyedState`]).
//!
//! # Rejected designs
//!
//! Measured by the `kv_index` bench (the conversation trace replayed 12×, 1,000 workers); the
//! runs are in `benchmarks/history/kv-index.md`.
//!
//! - One `RwLock` over the index, held for a whole 256-event batch: lookup p999 883 µs with a
//!   writer running, against 15 µs with a lock per node table taken one block at a time.
//! - A lookup that writes an overlap for every worker holding the first block (1,000 of them,
//!   12 KB, three vectors): mean 4.1 µs, against 0.6 µs with `Overlaps`.
//! - Prefetching 2, 8 or 16 blocks ahead: 4 to 6 were best, within the noise of each other.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

use foldhash::fast::FixedState;
use parking_lot::{MappedRwLockReadGuard, Mutex, RwLock, RwLockReadGuard};
use smallvec::SmallVec;
use switchyard_protocol::block_hash::chain_hash;
use switchyard_protocol::kv_events::{DumpBlock, KvEvent, StorageTier};

use super::table::{Added, Dropped, NodeTable, SlotsHint, prefetch};

/// A worker's id in the index (the pool's `kv_id`).
pub type WorkerId = u32;

/// A hash map keyed by block hashes, placed by [`KeyedState`] (every table that clients fill
/// with hashes of their prompts).
pub type HashKeyed<V> = HashMap<u64, V, KeyedState>;

/// Where block hashes land in tables: foldhash keyed by a per-process seed drawn from the
/// OS, so that no client can predict which hashes share a bucket.
#[derive(Debug, Clone)]
pub struct KeyedState(FixedState);

impl Default for KeyedState {
    fn default() -> KeyedState {
        static SEED: OnceLock<u64> = OnceLock::new();
        // std's RandomState draws its keys from the OS; hashing a constant with them yields a
        // random seed without another dependency.
        let seed = *SEED.get_or_init(|| RandomState::new().hash_one(0x5eed_u64));
        KeyedState(FixedState::with_seed(seed))
    }
}

impl BuildHasher for KeyedState {
    type Hasher = <FixedState as BuildHasher>::Hasher;

    fn build_hasher(&self) -> Self::Hasher {
        self.0.build_hasher()
    }
}

/// One worker's prefix overlap with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overlap {
    /// The worker.
    pub worker: WorkerId,
    /// Leading blocks on its device.
    pub device: u32,
    /// Blocks after those, on its host tier (or device).
    pub host: u32,
}

impl Overlap {
    /// The overlap of a worker holding the first block only, on `device` or only on host.
    fn first_block(worker: WorkerId, device: bool) -> Overlap {
        Overlap {
            worker,
            device: u32::from(device),
            host: u32::from(!device),
        }
    }
}

/// Every worker's prefix overlap with a request, as [`KvIndex::overlaps`] finds it: the holders
/// of the request's first block, and the overlaps of those whose run goes past it.
///
/// Kept in that form because the first block of a fleet's prompts (a system prompt, a chat
/// template's preamble) is often held by every worker: its holders are copied whole, where
/// writing an [`Overlap`] for each took most of a lookup at 1,000 workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overlaps {
    /// The first block's holder entries, sorted: every worker with any overlap.
    first: Vec<u32>,
    /// The overlaps of more than one block, sorted by worker.
    deeper: Vec<Overlap>,
}

impl Overlaps {
    /// The overlap of `worker`, if it holds the first block.
    pub fn get(&self, worker: WorkerId) -> Option<Overlap> {
        if let Ok(i) = self.deeper.binary_search_by_key(&worker, |o| o.worker) {
            return Some(self.deeper[i]);
        }
        tier_of(&self.first, worker).map(|device| Overlap::first_block(worker, device))
    }

    /// Every worker's overlap, sorted by worker.
    pub fn iter(&self) -> impl Iterator<Item = Overlap> + '_ {
        let mut deeper = self.deeper.iter().peekable();
        holdings(&self.first).map(move |(worker, device)| match deeper.next_if(|o| o.worker == worker) {
            Some(overlap) => *overlap,
            None => Overlap::first_block(worker, device),
        })
    }

    /// Workers with any overlap (counted through the first block's holders: O(workers)).
    pub fn len(&self) -> usize {
        holdings(&self.first).count()
    }

    /// Whether no worker holds the first block.
    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// Empties the set, keeping its memory.
    pub fn clear(&mut self) {
        self.first.clear();
        self.deeper.clear();
    }
}

/// What applying an event found wrong (the event is applied as far as it makes sense).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anomaly {
    /// A stored block's sequence hash does not chain from its parent and local hash: the
    /// worker hashes differently (another tokenizer, block size or seed).
    HashMismatch,
}

/// Size of the index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct IndexSize {
    /// Distinct cached blocks (nodes).
    pub nodes: usize,
    /// (worker, block, tier) holdings.
    pub blocks: usize,
    /// Workers holding at least one block.
    pub workers: usize,
}

fn holder(worker: WorkerId, tier: StorageTier) -> u32 {
    (worker << 1) | u32::from(tier == StorageTier::Host)
}

/// Number of node tables, each with its own lock.
pub const SHARDS: usize = 4096;

/// How many blocks ahead of the one being worked on an event or a lookup prefetches: enough
/// misses in flight to hide memory's latency behind the work of that many blocks.
pub const AHEAD: usize = 4;

/// One node table and its lock, alone on its cache lines so that a writer on one table does
/// not slow readers of its neighbours.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard {
    table: RwLock<NodeTable>,
}

/// Holdings per worker and in all, and nodes.
#[derive(Debug, Default)]
struct Counts {
    per_worker: HashMap<WorkerId, usize>,
    holdings: usize,
    nodes: usize,
}

/// What one event changed, counted without the counts' lock and applied once.
#[derive(Debug, Default, Clone, Copy)]
struct Change {
    holdings: usize,
    nodes: usize,
}

impl Counts {
    fn add(&mut self, worker: WorkerId, added: Change) {
        self.nodes += added.nodes;
        if added.holdings > 0 {
            *self.per_worker.entry(worker).or_default() += added.holdings;
            self.holdings += added.holdings;
        }
    }

    fn sub(&mut self, worker: WorkerId, removed: Change) {
        self.nodes = self.nodes.saturating_sub(removed.nodes);
        let removed = removed.holdings;
        if removed == 0 {
            return;
        }
        self.holdings = self.holdings.saturating_sub(removed);
        if let Some(count) = self.per_worker.get_mut(&worker) {
            *count = count.saturating_sub(removed);
            if *count == 0 {
                self.per_worker.remove(&worker);
            }
        }
        if self.per_worker.is_empty() {
            self.per_worker = HashMap::new();
        }
    }
}

/// The index; see the module documentation for how it is shared.
#[derive(Debug)]
pub struct KvIndex {
    shards: Box<[Shard]>,
    /// Where each shard's slots are, for prefetching: apart from the shards, whose 512 KiB
    /// would not stay in cache, these 64 KiB do.
    hints: Box<[SlotsHint]>,
    /// The keyed hash that places a block hash in a shard (and in its table).
    keyed: KeyedState,
    counts: Mutex<Counts>,
}

impl Default for KvIndex {
    fn default() -> KvIndex {
        KvIndex::new()
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> KvIndex {
        KvIndex {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            hints: (0..SHARDS).map(|_| SlotsHint::default()).collect(),
            keyed: KeyedState::default(),
            counts: Mutex::default(),
        }
    }

    /// The keyed hash of block `key` and its shard: bits 32..44 of the keyed hash, which the
    /// tables themselves do not use (they place a node by the low bits).
    fn place(&self, key: u64) -> (u64, usize) {
        let hash = self.keyed.hash_one(key);
        (hash, ((hash >> 32) as usize) & (SHARDS - 1))
    }

    /// Starts bringing the node of block `key`, and its shard's lock, into cache.
    fn prefetch(&self, key: u64) {
        let (hash, shard) = self.place(key);
        self.hints[shard].prefetch(hash);
        prefetch(&self.shards[shard]);
    }

    /// The holder entries of block `key`, read-locked.
    fn holders(&self, key: u64) -> Option<MappedRwLockReadGuard<'_, [u32]>> {
        let (hash, shard) = self.place(key);
        RwLockReadGuard::try_map(self.shards[shard].table.read(), |table| table.holders(hash, key)).ok()
    }

    /// Applies one event of `worker` on `tier`. Returns the anomalies found, if any.
    pub fn apply(&self, worker: WorkerId, tier: StorageTier, event: &KvEvent) -> Option<Anomaly> {
        match event {
            KvEvent::Stored { parent, blocks } => {
                let mut anomaly = None;
                let mut parent = *parent;
                let mut added = Change::default();
                self.each_prefetched(
                    blocks,
                    |block| block.block_hash,
                    |block| {
                        if chain_hash(parent, block.tokens_hash) != block.block_hash {
                            anomaly = Some(Anomaly::HashMismatch);
                        }
                        self.insert(worker, tier, block.block_hash, &mut added);
                        parent = Some(block.block_hash);
                    },
                );
                self.counts.lock().add(worker, added);
                anomaly
            }
            KvEvent::Removed { block_hashes } => {
                let mut removed = Change::default();
                self.each_prefetched(
                    block_hashes,
                    |&hash| hash,
                    |&hash| {
                        self.remove(worker, tier, hash, &mut removed);
                    },
                );
                self.counts.lock().sub(worker, removed);
                None
            }
            KvEvent::Cleared => {
                self.remove_worker(worker);
                None
            }
        }
    }

    /// Replaces everything `worker` holds with `blocks` (a resync). The dump's blocks are added
    /// first and the worker's others dropped after, so a lookup running meanwhile sees the
    /// worker hold its old blocks, the dump's or both, never fewer than either: a routing
    /// decision during a resync does not lose the worker's cache credit.
    pub fn load_dump(&self, worker: WorkerId, blocks: &[DumpBlock]) -> Option<Anomaly> {
        let held_before = self.counts.lock().per_worker.contains_key(&worker);
        let mut anomaly = None;
        let mut added = Change::default();
        self.each_prefetched(
            blocks,
            |block| block.block_hash,
            |block| {
                if chain_hash(block.parent, block.tokens_hash) != block.block_hash {
                    anomaly = Some(Anomaly::HashMismatch);
                }
                self.insert(worker, block.tier, block.block_hash, &mut added);
            },
        );
        self.counts.lock().add(worker, added);
        if held_before {
            let dumped: HashKeyed<SmallVec<[u32; 1]>> =
                blocks.iter().fold(HashKeyed::default(), |mut dumped, block| {
                    dumped
                        .entry(block.block_hash)
                        .or_default()
                        .push(holder(worker, block.tier));
                    dumped
                });
            self.drop_holdings(worker, |key, entry| {
                dumped.get(&key).is_some_and(|entries| entries.contains(&entry))
            });
        }
        anomaly
    }

    /// Calls `f` on each of `items` in order, while prefetching the node of the block
    /// [`AHEAD`] of it (`key_of` names an item's block).
    fn each_prefetched<T>(&self, items: &[T], key_of: impl Fn(&T) -> u64, mut f: impl FnMut(&T)) {
        for item in items.iter().take(AHEAD) {
            self.prefetch(key_of(item));
        }
        for (i, item) in items.iter().enumerate() {
            if let Some(ahead) = items.get(i + AHEAD) {
                self.prefetch(key_of(ahead));
            }
            f(item);
        }
    }

    /// Adds a holding, counting it (and its node) in `added` if new.
    fn insert(&self, worker: WorkerId, tier: StorageTier, key: u64, added: &mut Change) {
        let (hash, shard) = self.place(key);
        let mut table = self.shards[shard].table.write();
        match table.add(&self.keyed, hash, key, holder(worker, tier)) {
            Added::Nothing => {}
            Added::Holding => added.holdings += 1,
            Added::Node => {
                added.holdings += 1;
                added.nodes += 1;
            }
        }
        // The table may have grown (it grows before it looks for the block).
        self.hints[shard].update(&table);
    }

    /// Drops a holding, counting it (and its node, if freed) in `removed`.
    fn remove(&self, worker: WorkerId, tier: StorageTier, key: u64, removed: &mut Change) {
        let (hash, shard) = self.place(key);
        let mut table = self.shards[shard].table.write();
        match table.remove(&self.keyed, hash, key, holder(worker, tier)) {
            Dropped::Nothing => {}
            Dropped::Holding => removed.holdings += 1,
            Dropped::Node => {
                removed.holdings += 1;
                removed.nodes += 1;
            }
        }
    }

    /// Drops every block `worker` holds (a scan of the tables, one lock at a time: workers
    /// leave rarely).
    pub fn remove_worker(&self, worker: WorkerId) {
        if !self.counts.lock().per_worker.contains_key(&worker) {
            return;
        }
        self.drop_holdings(worker, |_, _| false);
    }

    /// Drops `worker`'s holdings that `keep` (given a block hash and the holder entry) does not
    /// accept, shard by shard, each under its own lock.
    fn drop_holdings(&self, worker: WorkerId, keep: impl Fn(u64, u32) -> bool) {
        let mut removed = Change::default();
        for (shard, hint) in self.shards.iter().zip(&self.hints) {
            let mut table = shard.table.write();
            if table.is_empty() {
                continue;
            }
            // The table is rebuilt at the size its survivors need: an emptied one gives its
            // memory back.
            let (holdings, nodes) = table.retain(&self.keyed, |key, entry| entry >> 1 != worker || keep(key, entry));
            removed.holdings += holdings;
            removed.nodes += nodes;
            hint.update(&table);
        }
        self.counts.lock().sub(worker, removed);
    }

    /// The overlap of every worker holding at least the first block of `sequence_hashes`
    /// (a request's sequence hashes, in order), into `out` (cleared first).
    pub fn overlaps(&self, sequence_hashes: &[u64], out: &mut Overlaps) {
        out.clear();
        let Some((&first, rest)) = sequence_hashes.split_first() else {
            return;
        };
        for &hash in rest.iter().take(AHEAD) {
            self.prefetch(hash);
        }
        match self.holders(first) {
            Some(root) => out.first.extend_from_slice(&root),
            None => return,
        }
        let Some((&second, rest)) = rest.split_first() else {
            return;
        };
        {
            let Some(node) = self.holders(second) else {
                return;
            };
            // The first block's holders that hold the second too start `deeper`.
            let mut start = |worker: WorkerId, on_device_first: bool, device: bool| {
                let mut overlap = Overlap::first_block(worker, on_device_first);
                extend(&mut overlap, device);
                out.deeper.push(overlap);
            };
            if node.len() * 8 < out.first.len() {
                for (worker, device) in holdings(&node) {
                    if let Some(on_device) = tier_of(&out.first, worker) {
                        start(worker, on_device, device);
                    }
                }
            } else {
                let mut firsts = holdings(&out.first).peekable();
                for (worker, device) in holdings(&node) {
                    while firsts.next_if(|&(w, _)| w < worker).is_some() {}
                    if let Some((_, on_device)) = firsts.next_if(|&(w, _)| w == worker) {
                        start(worker, on_device, device);
                    }
                }
            }
        }
        let deeper = &mut out.deeper;
        if deeper.is_empty() {
            return;
        }
        // The workers still extending their overlap, as indices into `deeper` (ascending, so
        // sorted by worker); while `all`, every one is and the list is not built.
        let mut all = true;
        let mut alive: SmallVec<[u32; 16]> = SmallVec::new();
        let mut next: SmallVec<[u32; 16]> = SmallVec::new();
        for (i, &hash) in rest.iter().enumerate() {
            if let Some(&ahead) = rest.get(i + AHEAD - 1) {
                self.prefetch(ahead);
            }
            let Some(node) = self.holders(hash) else {
                break;
            };
            next.clear();
            let (count, at): (usize, &dyn Fn(usize) -> usize) = if all {
                (deeper.len(), &|k| k)
            } else {
                (alive.len(), &|k| alive[k] as usize)
            };
            if node.len() * 8 < count {
                // Few holders among many workers: find each by bisection.
                for (worker, device) in holdings(&node) {
                    let (mut low, mut high) = (0, count);
                    while low < high {
                        let mid = (low + high) / 2;
                        if deeper[at(mid)].worker < worker {
                            low = mid + 1;
                        } else {
                            high = mid;
                        }
                    }
                    if low < count && deeper[at(low)].worker == worker {
                        let i = at(low);
                        extend(&mut deeper[i], device);
                        next.push(i as u32);
                    }
                }
            } else {
                // Comparable lists: one merge of the two sorted sequences.
                let mut k = 0;
                for (worker, device) in holdings(&node) {
                    while k < count && deeper[at(k)].worker < worker {
                        k += 1;
                    }
                    if k == count {
                        break;
                    }
                    let i = at(k);
                    if deeper[i].worker == worker {
                        extend(&mut deeper[i], device);
                        next.push(i as u32);
                        k += 1;
                    }
                }
            }
            drop(node);
            all = false;
            std::mem::swap(&mut alive, &mut next);
            if alive.is_empty() {
                break;
            }
        }
    }

    /// The size of the index.
    pub fn size(&self) -> IndexSize {
        let counts = self.counts.lock();
        IndexSize {
            nodes: counts.nodes,
            blocks: counts.holdings,
            workers: counts.per_worker.len(),
        }
    }

    /// Holdings of `worker` (a block on both tiers counts twice).
    pub fn worker_blocks(&self, worker: WorkerId) -> usize {
        self.counts.lock().per_worker.get(&worker).copied().unwrap_or(0)
    }

    /// An estimate of the heap the index occupies, from its maps' capacities.
    pub fn heap_bytes(&self) -> usize {
        let worker = std::mem::size_of::<(WorkerId, usize)>() + 1;
        let tables: usize = self.shards.iter().map(|shard| shard.table.read().heap_bytes()).sum();
        tables
            + (std::mem::size_of::<Shard>() + std::mem::size_of::<SlotsHint>()) * SHARDS
            + self.counts.lock().per_worker.capacity() * worker
    }
}

/// A node's holders as (worker, holds it on device): a worker's device entry sorts just before
/// its host entry, and a block held on both tiers counts as on device.
fn holdings(holders: &[u32]) -> impl Iterator<Item = (WorkerId, bool)> + '_ {
    let mut entries = holders.iter().peekable();
    std::iter::from_fn(move || {
        let entry = *entries.next()?;
        let worker = entry >> 1;
        if entries.peek().is_some_and(|&&following| following >> 1 == worker) {
            entries.next();
        }
        Some((worker, entry & 1 == 0))
    })
}

/// Whether `worker` holds the node of `holders` on device (`Some(true)`), only on host
/// (`Some(false)`), or not at all.
fn tier_of(holders: &[u32], worker: WorkerId) -> Option<bool> {
    match holders.binary_search(&(worker << 1)) {
        Ok(_) => Some(true),
        Err(i) => (holders.get(i) == Some(&((worker << 1) | 1))).then_some(false),
    }
}

/// Extends a worker's overlap by one block it holds, on `device` or only on host. A worker's
/// device run goes on until its first host-only block, so it is still going while `host` is 0.
fn extend(overlap: &mut Overlap, device: bool) {
    if overlap.host == 0 && device {
        overlap.device += 1;
    } else {
        overlap.host += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_protocol::block_hash::block_hashes;
    use switchyard_protocol::kv_events::StoredBlock;

    fn chain(tokens: &[u32]) -> Vec<StoredBlock> {
        block_hashes(tokens, 2)
            .into_iter()
            .map(|h| StoredBlock {
                block_hash: h.sequence,
                tokens_hash: h.local,
            })
            .collect()
    }

    fn store(index: &KvIndex, worker: WorkerId, tier: StorageTier, blocks: &[StoredBlock]) -> Option<Anomaly> {
        index.apply(
            worker,
            tier,
            &KvEvent::Stored {
                parent: None,
                blocks: blocks.to_vec(),
            },
        )
    }

    /// The size, checked against a scan of the tables.
    fn size(index: &KvIndex) -> IndexSize {
        let size = index.size();
        let scanned: usize = index.shards.iter().map(|shard| shard.table.read().len()).sum();
        assert_eq!(size.nodes, scanned, "counted nodes differ from the tables'");
        size
    }

    fn lookup(index: &KvIndex, blocks: &[StoredBlock]) -> Vec<(u32, u32, u32)> {
        let hashes: Vec<u64> = blocks.iter().map(|b| b.block_hash).collect();
        let mut out = Overlaps::default();
        index.overlaps(&hashes, &mut out);
        let listed: Vec<(u32, u32, u32)> = out.iter().map(|o| (o.worker, o.device, o.host)).collect();
        assert_eq!(listed.len(), out.len());
        for o in out.iter() {
            assert_eq!(out.get(o.worker), Some(o), "get() and iter() disagree");
        }
        listed
    }

    #[test]
    fn overlap_counts_leading_blocks_per_worker() {
        let index = KvIndex::new();
        let long = chain(&[1, 1, 2, 2, 3, 3, 4, 4]);
        assert_eq!(store(&index, 7, StorageTier::Device, &long[..3]), None);
        store(&index, 2, StorageTier::Device, &long[..1]);
        store(&index, 9, StorageTier::Device, &chain(&[5, 5]));
        assert_eq!(lookup(&index, &long), vec![(2, 1, 0), (7, 3, 0)]);
        assert_eq!(lookup(&index, &chain(&[9, 9])), vec![]);
        assert_eq!(
            size(&index),
            IndexSize {
                nodes: 4,
                blocks: 5,
                workers: 3
            }
        );
    }

    #[test]
    fn host_tier_extends_after_the_device_run() {
        let index = KvIndex::new();
        let blocks = chain(&[1, 1, 2, 2, 3, 3, 4, 4]);
        store(&index, 1, StorageTier::Device, &blocks[..2]);
        store(&index, 1, StorageTier::Host, &blocks[1..4]);
        store(&index, 3, StorageTier::Host, &blocks[..2]);
        assert_eq!(lookup(&index, &blocks), vec![(1, 2, 2), (3, 0, 2)]);
    }

    #[test]
    fn a_gap_in_a_workers_chain_ends_its_overlap() {
        let index = KvIndex::new();
        let blocks = chain(&[1, 1, 2, 2, 3, 3]);
        store(&index, 1, StorageTier::Device, &blocks);
        index.apply(
            1,
            StorageTier::Device,
            &KvEvent::Removed {
                block_hashes: vec![blocks[1].block_hash],
            },
        );
        assert_eq!(lookup(&index, &blocks), vec![(1, 1, 0)]);
    }

    #[test]
    fn many_workers_take_the_sparse_path() {
        let index = KvIndex::new();
        let blocks = chain(&[1, 1, 2, 2, 3, 3]);
        for worker in 0..100 {
            store(&index, worker, StorageTier::Device, &blocks[..1]);
        }
        store(&index, 42, StorageTier::Device, &blocks);
        store(&index, 43, StorageTier::Host, &blocks);
        let found = lookup(&index, &blocks);
        assert_eq!(found.len(), 100);
        assert_eq!(found[42], (42, 3, 0));
        assert_eq!(found[43], (43, 1, 2));
        assert_eq!(found[41], (41, 1, 0));
    }

    #[test]
    fn removing_the_last_holder_frees_the_node() {
        let index = KvIndex::new();
        let blocks = chain(&[1, 1, 2, 2]);
        store(&index, 1, StorageTier::Device, &blocks);
        store(&index, 2, StorageTier::Device, &blocks[..1]);
        index.remove_worker(1);
        assert_eq!(
            size(&index),
            IndexSize {
                nodes: 1,
                blocks: 1,
                workers: 1
            }
        );
        index.apply(2, StorageTier::Device, &KvEvent::Cleared);
        assert_eq!(size(&index), IndexSize::default());
        assert_eq!(lookup(&index, &blocks), vec![]);
    }

    #[test]
    fn removing_unknown_blocks_is_harmless() {
        let index = KvIndex::new();
        index.apply(
            1,
            StorageTier::Device,
            &KvEvent::Removed {
                block_hashes: vec![1, 2],
            },
        );
        let blocks = chain(&[1, 1]);
        store(&index, 1, StorageTier::Device, &blocks);
        store(&index, 1, StorageTier::Device, &blocks);
        index.apply(
            1,
            StorageTier::Host,
            &KvEvent::Removed {
                block_hashes: vec![blocks[0].block_hash],
            },
        );
        assert_eq!(
            size(&index),
            IndexSize {
                nodes: 1,
                blocks: 1,
                workers: 1
            }
        );
    }

    #[test]
    fn foreign_hashing_is_reported() {
        let index = KvIndex::new();
        let mut blocks = chain(&[1, 1, 2, 2]);
        blocks[1].tokens_hash ^= 1;
        assert_eq!(
            store(&index, 1, StorageTier::Device, &blocks),
            Some(Anomaly::HashMismatch)
        );
    }

    #[test]
    fn dumps_replace_a_workers_blocks() {
        let index = KvIndex::new();
        let old = chain(&[1, 1]);
        let new = chain(&[2, 2, 3, 3]);
        store(&index, 1, StorageTier::Device, &old);
        store(&index, 2, StorageTier::Device, &old);
        // The dump holds one of the worker's old blocks, on the host now, and new ones.
        let mut dump = dump_of(&new, StorageTier::Device);
        dump.extend(dump_of(&old, StorageTier::Host));
        assert_eq!(index.load_dump(1, &dump), None);
        assert_eq!(lookup(&index, &old), vec![(1, 0, 1), (2, 1, 0)]);
        assert_eq!(lookup(&index, &new), vec![(1, 2, 0)]);
        assert_eq!(
            size(&index),
            IndexSize {
                nodes: 3,
                blocks: 4,
                workers: 2
            }
        );
        index.load_dump(1, &[]);
        assert_eq!(lookup(&index, &new), vec![]);
        assert_eq!(
            size(&index),
            IndexSize {
                nodes: 1,
                blocks: 1,
                workers: 1
            }
        );
    }

    /// `blocks` as a worker's dump lists them, on `tier`.
    fn dump_of(blocks: &[StoredBlock], tier: StorageTier) -> Vec<DumpBlock> {
        blocks
            .iter()
            .scan(None, |parent, b| {
                let block = DumpBlock {
                    block_hash: b.block_hash,
                    parent: *parent,
                    tokens_hash: b.tokens_hash,
                    tier,
                };
                *parent = Some(b.block_hash);
                Some(block)
            })
            .collect()
    }

    #[test]
    fn a_lookup_during_a_resync_sees_every_block_the_old_and_new_holdings_share() {
        // A worker resynced with the blocks it already holds: emptying it before refilling it
        // (as this index once did) showed lookups a worker with fewer blocks, or none, and
        // routing took its cache credit away for that moment.
        let tokens: Vec<u32> = (0..2 * 20_000).collect();
        let blocks = chain(&tokens);
        let dump = dump_of(&blocks, StorageTier::Device);
        let index = KvIndex::new();
        store(&index, 1, StorageTier::Device, &blocks);
        let hashes: Vec<u64> = blocks.iter().map(|b| b.block_hash).collect();
        let done = std::sync::atomic::AtomicBool::new(false);
        let (lookups, short) = std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..20 {
                    index.load_dump(1, &dump);
                }
                done.store(true, std::sync::atomic::Ordering::Release);
            });
            let mut out = Overlaps::default();
            let (mut lookups, mut short) = (0, 0);
            loop {
                let finished = done.load(std::sync::atomic::Ordering::Acquire);
                index.overlaps(&hashes, &mut out);
                lookups += 1;
                if out.get(1).map(|o| o.device as usize) != Some(blocks.len()) {
                    short += 1;
                }
                if finished {
                    break (lookups, short);
                }
            }
        });
        assert_eq!(
            short, 0,
            "{short} of {lookups} lookups saw the worker short of its blocks"
        );
        assert_eq!(lookup(&index, &blocks), vec![(1, blocks.len() as u32, 0)]);
    }

    #[test]
    fn a_lookup_runs_while_an_event_is_being_applied() {
        // One long event: under a lock held per event (or per batch) a lookup would wait for
        // all of it and see either none or all of its blocks; here a lookup made as soon as the
        // event's first block shows finds its last one still missing. The reader asks for one
        // block at a time: a lookup of the whole chain walks the blocks stored so far and, on a
        // loaded machine, can trail the writer to its end. A reader descheduled for the whole
        // event would also see all of it, so a few tries are allowed; a lock makes every try
        // see all.
        let tokens: Vec<u32> = (0..2 * 100_000).collect();
        let blocks = chain(&tokens);
        let (first, last) = (blocks[0].block_hash, blocks[blocks.len() - 1].block_hash);
        let event = KvEvent::Stored {
            parent: None,
            blocks: blocks.clone(),
        };
        let tries = 10;
        for _ in 0..tries {
            let index = KvIndex::new();
            let last_seen_with_the_first = std::thread::scope(|s| {
                let writer = s.spawn(|| index.apply(1, StorageTier::Device, &event));
                let mut out = Overlaps::default();
                loop {
                    index.overlaps(&[first], &mut out);
                    if out.iter().next().is_some() {
                        break;
                    }
                    std::hint::spin_loop();
                }
                index.overlaps(&[last], &mut out);
                let seen = out.iter().next().is_some();
                assert_eq!(writer.join().unwrap(), None);
                seen
            });
            assert_eq!(lookup(&index, &blocks), vec![(1, blocks.len() as u32, 0)]);
            assert_eq!(size(&index).blocks, blocks.len());
            if !last_seen_with_the_first {
                return;
            }
        }
        panic!(
            "in {tries} tries the event's last block was always there as soon as its first was: \
             lookups waited for the whole event"
        );
    }

    #[test]
    fn block_hashes_are_placed_by_a_keyed_hash() {
        // Two states of one process agree (the index and its tables must), and neither passes
        // a hash through: hashes that share their low and shard bits land apart.
        let (a, b) = (KeyedState::default(), KeyedState::default());
        let index = KvIndex::new();
        let mut shards = std::collections::HashSet::new();
        for i in 0..64u64 {
            let crafted = i << 48;
            assert_eq!(a.hash_one(crafted), b.hash_one(crafted));
            shards.insert(index.place(crafted).1);
        }
        assert!(shards.len() > 32, "crafted hashes crowd into {} shards", shards.len());
    }
}
