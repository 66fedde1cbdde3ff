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
//! Memory is bounded by what workers hold: a node is freed when its last holder leaves. Each
//! holding is stored once, in its node (most nodes have one holder, kept inline); dropping a
//! whole worker (it left, or sent `cleared`) is rare, so it scans the tables instead of keeping
//! a second per-worker copy of every holding.
//!
//! Block hashes come from prompts, and the hashing is public (xxh3 with a fixed seed), so a
//! client could craft prompts whose hashes share low bits and pile them into one bucket chain.
//! Tables and shards are therefore picked by a keyed hash (foldhash) of the block hash, seeded
//! per process from the OS's randomness ([`KeyedState`]).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

use foldhash::fast::FixedState;
use parking_lot::{MappedRwLockReadGuard, Mutex, RwLock, RwLockReadGuard};
use smallvec::SmallVec;
use switchyard_protocol::block_hash::chain_hash;
use switchyard_protocol::kv_events::{DumpBlock, KvEvent, StorageTier};

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

#[derive(Debug, Default)]
struct Node {
    holders: SmallVec<[u32; 4]>,
}

fn holder(worker: WorkerId, tier: StorageTier) -> u32 {
    (worker << 1) | u32::from(tier == StorageTier::Host)
}

/// Number of node tables, each with its own lock.
pub const SHARDS: usize = 4096;

type Table = HashKeyed<Node>;

/// One node table and its lock, alone on its cache lines so that a writer on one table does
/// not slow readers of its neighbours.
#[derive(Debug)]
#[repr(align(128))]
struct Shard(RwLock<Table>);

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
            shards: (0..SHARDS).map(|_| Shard(RwLock::default())).collect(),
            keyed: KeyedState::default(),
            counts: Mutex::default(),
        }
    }

    /// The shard of `hash`: bits 32..44 of its keyed hash, which the tables themselves do not
    /// use (they index buckets by the low bits and tag them by the top 7).
    fn shard(&self, hash: u64) -> &RwLock<Table> {
        let keyed = self.keyed.hash_one(hash);
        &self.shards[((keyed >> 32) as usize) & (SHARDS - 1)].0
    }

    fn node(&self, hash: u64) -> Option<MappedRwLockReadGuard<'_, Node>> {
        RwLockReadGuard::try_map(self.shard(hash).read(), |table| table.get(&hash)).ok()
    }

    /// Applies one event of `worker` on `tier`. Returns the anomalies found, if any.
    pub fn apply(&self, worker: WorkerId, tier: StorageTier, event: &KvEvent) -> Option<Anomaly> {
        match event {
            KvEvent::Stored { parent, blocks } => {
                let mut anomaly = None;
                let mut parent = *parent;
                let mut added = Change::default();
                for block in blocks {
                    if chain_hash(parent, block.tokens_hash) != block.block_hash {
                        anomaly = Some(Anomaly::HashMismatch);
                    }
                    self.insert(worker, tier, block.block_hash, &mut added);
                    parent = Some(block.block_hash);
                }
                self.counts.lock().add(worker, added);
                anomaly
            }
            KvEvent::Removed { block_hashes } => {
                let mut removed = Change::default();
                for &hash in block_hashes {
                    self.remove(worker, tier, hash, &mut removed);
                }
                self.counts.lock().sub(worker, removed);
                None
            }
            KvEvent::Cleared => {
                self.remove_worker(worker);
                None
            }
        }
    }

    /// Replaces everything `worker` holds with `blocks` (a resync). Lookups running meanwhile
    /// may see the worker partly loaded.
    pub fn load_dump(&self, worker: WorkerId, blocks: &[DumpBlock]) -> Option<Anomaly> {
        self.remove_worker(worker);
        let mut anomaly = None;
        let mut added = Change::default();
        for block in blocks {
            if chain_hash(block.parent, block.tokens_hash) != block.block_hash {
                anomaly = Some(Anomaly::HashMismatch);
            }
            self.insert(worker, block.tier, block.block_hash, &mut added);
        }
        self.counts.lock().add(worker, added);
        anomaly
    }

    /// Adds a holding, counting it (and its node) in `added` if new.
    fn insert(&self, worker: WorkerId, tier: StorageTier, hash: u64, added: &mut Change) {
        let mut table = self.shard(hash).write();
        let holders = &mut table.entry(hash).or_default().holders;
        let entry = holder(worker, tier);
        if let Err(position) = holders.binary_search(&entry) {
            added.nodes += usize::from(holders.is_empty());
            holders.insert(position, entry);
            added.holdings += 1;
        }
    }

    /// Drops a holding, counting it (and its node, if freed) in `removed`.
    fn remove(&self, worker: WorkerId, tier: StorageTier, hash: u64, removed: &mut Change) {
        let mut table = self.shard(hash).write();
        let Some(node) = table.get_mut(&hash) else {
            return;
        };
        let Ok(position) = node.holders.binary_search(&holder(worker, tier)) else {
            return;
        };
        node.holders.remove(position);
        removed.holdings += 1;
        if node.holders.is_empty() {
            table.remove(&hash);
            removed.nodes += 1;
        }
    }

    /// Drops every block `worker` holds (a scan of the tables, one lock at a time: workers
    /// leave rarely).
    pub fn remove_worker(&self, worker: WorkerId) {
        if !self.counts.lock().per_worker.contains_key(&worker) {
            return;
        }
        let mut removed = Change::default();
        for shard in &self.shards {
            let mut table = shard.0.write();
            table.retain(|_, node| {
                let before = node.holders.len();
                node.holders.retain(|entry| *entry >> 1 != worker);
                removed.holdings += before - node.holders.len();
                removed.nodes += usize::from(node.holders.is_empty());
                !node.holders.is_empty()
            });
            if table.is_empty() && table.capacity() > 0 {
                // An emptied table gives its memory back.
                *table = Table::default();
            }
        }
        self.counts.lock().sub(worker, removed);
    }

    /// The overlap of every worker holding at least the first block of `sequence_hashes`
    /// (a request's sequence hashes, in order), sorted by worker, into `out` (cleared first).
    pub fn overlaps(&self, sequence_hashes: &[u64], out: &mut Vec<Overlap>) {
        out.clear();
        let Some((&first, rest)) = sequence_hashes.split_first() else {
            return;
        };
        // `on_device[i]`: worker `out[i]` still extends its device run.
        let mut on_device: Vec<bool> = Vec::new();
        {
            let Some(root) = self.node(first) else {
                return;
            };
            for &entry in &root.holders {
                let worker = entry >> 1;
                let on_host = entry & 1 == 1;
                match out.last_mut() {
                    Some(last) if last.worker == worker => {} // host copy of a device block
                    _ => {
                        out.push(Overlap {
                            worker,
                            device: u32::from(!on_host),
                            host: u32::from(on_host),
                        });
                        on_device.push(!on_host);
                    }
                }
            }
        }
        let mut alive: Vec<usize> = (0..out.len()).collect();
        let mut next: Vec<usize> = Vec::with_capacity(alive.len());
        for hash in rest {
            let Some(node) = self.node(*hash) else {
                break;
            };
            next.clear();
            let holders = &node.holders;
            if holders.len() * 8 < alive.len() {
                // Few holders: find each among the alive workers.
                let mut entries = holders.iter().peekable();
                while let Some(&entry) = entries.next() {
                    let worker = entry >> 1;
                    // A worker's device entry sorts just before its host entry.
                    let device = entry & 1 == 0;
                    if let Some(&&following) = entries.peek()
                        && following >> 1 == worker
                    {
                        entries.next();
                    }
                    if let Ok(slot) = alive.binary_search_by_key(&worker, |&i| out[i].worker) {
                        let i = alive[slot];
                        extend(&mut out[i], &mut on_device[i], device);
                        next.push(i);
                    }
                }
            } else {
                for &i in &alive {
                    let worker = out[i].worker;
                    let device = holders.binary_search(&(worker << 1)).is_ok();
                    let host = holders.binary_search(&((worker << 1) | 1)).is_ok();
                    if device || host {
                        extend(&mut out[i], &mut on_device[i], device);
                        next.push(i);
                    }
                }
            }
            drop(node);
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
        let slot = std::mem::size_of::<(u64, Node)>() + 1;
        let worker = std::mem::size_of::<(WorkerId, usize)>() + 1;
        let tables: usize = self
            .shards
            .iter()
            .map(|shard| {
                let table = shard.0.read();
                table.capacity() * slot
                    + table
                        .values()
                        .filter(|n| n.holders.spilled())
                        .map(|n| n.holders.capacity() * 4)
                        .sum::<usize>()
            })
            .sum();
        tables + std::mem::size_of::<Shard>() * SHARDS + self.counts.lock().per_worker.capacity() * worker
    }
}

/// Extends a worker's overlap by one block it holds on `device` and/or `host`.
fn extend(overlap: &mut Overlap, on_device: &mut bool, device: bool) {
    if *on_device && device {
        overlap.device += 1;
    } else {
        *on_device = false;
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
        let scanned: usize = index.shards.iter().map(|shard| shard.0.read().len()).sum();
        assert_eq!(size.nodes, scanned, "counted nodes differ from the tables'");
        size
    }

    fn lookup(index: &KvIndex, blocks: &[StoredBlock]) -> Vec<(u32, u32, u32)> {
        let hashes: Vec<u64> = blocks.iter().map(|b| b.block_hash).collect();
        let mut out = Vec::new();
        index.overlaps(&hashes, &mut out);
        out.iter().map(|o| (o.worker, o.device, o.host)).collect()
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
        let dump: Vec<DumpBlock> = new
            .iter()
            .scan(None, |parent, b| {
                let block = DumpBlock {
                    block_hash: b.block_hash,
                    parent: *parent,
                    tokens_hash: b.tokens_hash,
                    tier: StorageTier::Device,
                };
                *parent = Some(b.block_hash);
                Some(block)
            })
            .collect();
        assert_eq!(index.load_dump(1, &dump), None);
        assert_eq!(lookup(&index, &old), vec![]);
        assert_eq!(lookup(&index, &new), vec![(1, 2, 0)]);
    }

    #[test]
    fn a_lookup_runs_while_an_event_is_being_applied() {
        // One long event: under a lock held per event (or per batch) a lookup would wait for
        // all of it and see either none or all of its blocks; here it sees a part. A reader
        // descheduled for the whole event would also see all of it, so a few tries are
        // allowed; a lock makes every try see all.
        let tokens: Vec<u32> = (0..2 * 100_000).collect();
        let blocks = chain(&tokens);
        let hashes: Vec<u64> = blocks.iter().map(|b| b.block_hash).collect();
        let event = KvEvent::Stored {
            parent: None,
            blocks: blocks.clone(),
        };
        let mut seen_per_try = Vec::new();
        for _ in 0..3 {
            let index = KvIndex::new();
            let seen = std::thread::scope(|s| {
                let writer = s.spawn(|| index.apply(1, StorageTier::Device, &event));
                let mut out = Vec::new();
                let seen = loop {
                    index.overlaps(&hashes, &mut out);
                    if let Some(first) = out.first() {
                        break first.device as usize;
                    }
                    std::hint::spin_loop();
                };
                assert_eq!(writer.join().unwrap(), None);
                seen
            });
            assert_eq!(lookup(&index, &blocks), vec![(1, blocks.len() as u32, 0)]);
            assert_eq!(size(&index).blocks, blocks.len());
            seen_per_try.push(seen);
            if seen < blocks.len() {
                return;
            }
        }
        panic!(
            "every lookup saw all {} blocks ({seen_per_try:?}): it waited for the whole event",
            blocks.len()
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
            shards.insert(std::ptr::from_ref(index.shard(crafted)));
        }
        assert!(shards.len() > 32, "crafted hashes crowd into {} shards", shards.len());
    }
}
