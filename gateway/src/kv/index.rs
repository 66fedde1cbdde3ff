//! The prefix index: which worker holds which cached block, and per-worker prefix overlap.
//!
//! A radix tree over blocks in which a node's identity is its whole path: nodes are keyed by
//! the block's *sequence* hash, which already chains every block before it (see
//! `switchyard_protocol::block_hash`), so the tree is stored flat in one hash map and a child is
//! found from its parent by the request's next sequence hash, with no per-node child map. Each
//! node holds a sorted list of holders, `worker << 1 | tier` (tier 0 device, 1 host), mostly
//! inline. A lookup walks the request's sequence hashes from the root, carrying the workers
//! still matching; a worker's device overlap is the run of leading blocks it holds on device,
//! its host overlap the run that continues from there on host (or device).
//!
//! Memory is bounded by what workers hold: a node is freed when its last holder leaves. Each
//! holding is stored once, in its node (most nodes have one holder, kept inline); dropping a
//! whole worker (it left, or sent `cleared`) is rare, so it scans the nodes instead of keeping
//! a second per-worker copy of every holding. The keys are already uniform 64-bit hashes, so
//! the map uses them as their own hash.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use smallvec::SmallVec;
use switchyard_protocol::block_hash::chain_hash;
use switchyard_protocol::kv_events::{DumpBlock, KvEvent, StorageTier};

/// A worker's id in the index (the pool's `kv_id`).
pub type WorkerId = u32;

/// A hasher for keys that are already uniform 64-bit hashes: it passes them through.
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed through this; fold anything else in for safety.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

/// A hash map keyed by block hashes.
pub type HashKeyed<V> = HashMap<u64, V, BuildHasherDefault<PassThroughHasher>>;

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

/// The node table, split in [`SHARDS`] tables by bits of the hash that the tables themselves
/// do not use, so that growing one (a rehash, under the index's write lock) moves 1/64 of the
/// nodes: a lookup never waits behind a whole-index rehash.
#[derive(Debug)]
struct Shards {
    shards: Vec<HashKeyed<Node>>,
}

/// Number of node tables.
const SHARDS: usize = 64;

impl Default for Shards {
    fn default() -> Shards {
        Shards {
            shards: (0..SHARDS).map(|_| HashKeyed::default()).collect(),
        }
    }
}

impl Shards {
    /// Bits 32..38: hash tables index buckets by the low bits and tag them by the top 7.
    fn index(hash: u64) -> usize {
        ((hash >> 32) as usize) & (SHARDS - 1)
    }

    fn get(&self, hash: u64) -> Option<&Node> {
        self.shards[Shards::index(hash)].get(&hash)
    }

    fn shard_mut(&mut self, hash: u64) -> &mut HashKeyed<Node> {
        &mut self.shards[Shards::index(hash)]
    }

    fn len(&self) -> usize {
        self.shards.iter().map(HashMap::len).sum()
    }
}

/// The index. Not synchronised: see `crate::kv` for how it is shared.
#[derive(Debug, Default)]
pub struct KvIndex {
    nodes: Shards,
    /// Per worker: how many holdings it has.
    workers: HashMap<WorkerId, usize>,
    holdings: usize,
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> KvIndex {
        KvIndex::default()
    }

    /// Applies one event of `worker` on `tier`. Returns the anomalies found, if any.
    pub fn apply(&mut self, worker: WorkerId, tier: StorageTier, event: &KvEvent) -> Option<Anomaly> {
        match event {
            KvEvent::Stored { parent, blocks } => {
                let mut anomaly = None;
                let mut parent = *parent;
                for block in blocks {
                    if chain_hash(parent, block.tokens_hash) != block.block_hash {
                        anomaly = Some(Anomaly::HashMismatch);
                    }
                    self.insert(worker, tier, block.block_hash);
                    parent = Some(block.block_hash);
                }
                anomaly
            }
            KvEvent::Removed { block_hashes } => {
                for &hash in block_hashes {
                    self.remove(worker, tier, hash);
                }
                None
            }
            KvEvent::Cleared => {
                self.remove_worker(worker);
                None
            }
        }
    }

    /// Replaces everything `worker` holds with `blocks` (a resync).
    pub fn load_dump(&mut self, worker: WorkerId, blocks: &[DumpBlock]) -> Option<Anomaly> {
        self.remove_worker(worker);
        let mut anomaly = None;
        for block in blocks {
            if chain_hash(block.parent, block.tokens_hash) != block.block_hash {
                anomaly = Some(Anomaly::HashMismatch);
            }
            self.insert(worker, block.tier, block.block_hash);
        }
        anomaly
    }

    fn insert(&mut self, worker: WorkerId, tier: StorageTier, hash: u64) {
        let holders = &mut self.nodes.shard_mut(hash).entry(hash).or_default().holders;
        let entry = holder(worker, tier);
        if let Err(position) = holders.binary_search(&entry) {
            holders.insert(position, entry);
            *self.workers.entry(worker).or_default() += 1;
            self.holdings += 1;
        }
    }

    fn remove(&mut self, worker: WorkerId, tier: StorageTier, hash: u64) {
        let shard = self.nodes.shard_mut(hash);
        let Some(node) = shard.get_mut(&hash) else {
            return;
        };
        let Ok(position) = node.holders.binary_search(&holder(worker, tier)) else {
            return;
        };
        node.holders.remove(position);
        if node.holders.is_empty() {
            shard.remove(&hash);
        }
        self.holdings -= 1;
        if let Some(count) = self.workers.get_mut(&worker) {
            *count -= 1;
            if *count == 0 {
                self.workers.remove(&worker);
            }
        }
    }

    /// Drops every block `worker` holds (a scan of the nodes: workers leave rarely).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let Some(count) = self.workers.remove(&worker) else {
            return;
        };
        for shard in &mut self.nodes.shards {
            shard.retain(|_, node| {
                node.holders.retain(|entry| *entry >> 1 != worker);
                !node.holders.is_empty()
            });
        }
        self.holdings -= count;
        if self.nodes.len() == 0 {
            // An emptied index gives its tables back.
            self.nodes = Shards::default();
        }
        if self.workers.is_empty() {
            self.workers = HashMap::new();
        }
    }

    /// The overlap of every worker holding at least the first block of `sequence_hashes`
    /// (a request's sequence hashes, in order), sorted by worker, into `out` (cleared first).
    pub fn overlaps(&self, sequence_hashes: &[u64], out: &mut Vec<Overlap>) {
        out.clear();
        let Some((&first, rest)) = sequence_hashes.split_first() else {
            return;
        };
        let Some(root) = self.nodes.get(first) else {
            return;
        };
        // `on_device[i]`: worker `out[i]` still extends its device run.
        let mut on_device: Vec<bool> = Vec::new();
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
        let mut alive: Vec<usize> = (0..out.len()).collect();
        let mut next: Vec<usize> = Vec::with_capacity(alive.len());
        for hash in rest {
            let Some(node) = self.nodes.get(*hash) else {
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
            std::mem::swap(&mut alive, &mut next);
            if alive.is_empty() {
                break;
            }
        }
    }

    /// The size of the index.
    pub fn size(&self) -> IndexSize {
        IndexSize {
            nodes: self.nodes.len(),
            blocks: self.holdings,
            workers: self.workers.len(),
        }
    }

    /// Holdings of `worker` (a block on both tiers counts twice).
    pub fn worker_blocks(&self, worker: WorkerId) -> usize {
        self.workers.get(&worker).copied().unwrap_or(0)
    }

    /// An estimate of the heap the index occupies, from its maps' capacities.
    pub fn heap_bytes(&self) -> usize {
        let slot = std::mem::size_of::<(u64, Node)>() + 1;
        let worker = std::mem::size_of::<(WorkerId, usize)>() + 1;
        self.nodes.shards.iter().map(|s| s.capacity() * slot).sum::<usize>()
            + self
                .nodes
                .shards
                .iter()
                .flat_map(|s| s.values())
                .filter(|n| n.holders.spilled())
                .map(|n| n.holders.capacity() * 4)
                .sum::<usize>()
            + self.workers.capacity() * worker
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

    fn store(index: &mut KvIndex, worker: WorkerId, tier: StorageTier, blocks: &[StoredBlock]) -> Option<Anomaly> {
        index.apply(
            worker,
            tier,
            &KvEvent::Stored {
                parent: None,
                blocks: blocks.to_vec(),
            },
        )
    }

    fn lookup(index: &KvIndex, blocks: &[StoredBlock]) -> Vec<(u32, u32, u32)> {
        let hashes: Vec<u64> = blocks.iter().map(|b| b.block_hash).collect();
        let mut out = Vec::new();
        index.overlaps(&hashes, &mut out);
        out.iter().map(|o| (o.worker, o.device, o.host)).collect()
    }

    #[test]
    fn overlap_counts_leading_blocks_per_worker() {
        let mut index = KvIndex::new();
        let long = chain(&[1, 1, 2, 2, 3, 3, 4, 4]);
        assert_eq!(store(&mut index, 7, StorageTier::Device, &long[..3]), None);
        store(&mut index, 2, StorageTier::Device, &long[..1]);
        store(&mut index, 9, StorageTier::Device, &chain(&[5, 5]));
        assert_eq!(lookup(&index, &long), vec![(2, 1, 0), (7, 3, 0)]);
        assert_eq!(lookup(&index, &chain(&[9, 9])), vec![]);
        assert_eq!(
            index.size(),
            IndexSize {
                nodes: 4,
                blocks: 5,
                workers: 3
            }
        );
    }

    #[test]
    fn host_tier_extends_after_the_device_run() {
        let mut index = KvIndex::new();
        let blocks = chain(&[1, 1, 2, 2, 3, 3, 4, 4]);
        store(&mut index, 1, StorageTier::Device, &blocks[..2]);
        store(&mut index, 1, StorageTier::Host, &blocks[1..4]);
        store(&mut index, 3, StorageTier::Host, &blocks[..2]);
        assert_eq!(lookup(&index, &blocks), vec![(1, 2, 2), (3, 0, 2)]);
    }

    #[test]
    fn a_gap_in_a_workers_chain_ends_its_overlap() {
        let mut index = KvIndex::new();
        let blocks = chain(&[1, 1, 2, 2, 3, 3]);
        store(&mut index, 1, StorageTier::Device, &blocks);
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
        let mut index = KvIndex::new();
        let blocks = chain(&[1, 1, 2, 2, 3, 3]);
        for worker in 0..100 {
            store(&mut index, worker, StorageTier::Device, &blocks[..1]);
        }
        store(&mut index, 42, StorageTier::Device, &blocks);
        store(&mut index, 43, StorageTier::Host, &blocks);
        let found = lookup(&index, &blocks);
        assert_eq!(found.len(), 100);
        assert_eq!(found[42], (42, 3, 0));
        assert_eq!(found[43], (43, 1, 2));
        assert_eq!(found[41], (41, 1, 0));
    }

    #[test]
    fn removing_the_last_holder_frees_the_node() {
        let mut index = KvIndex::new();
        let blocks = chain(&[1, 1, 2, 2]);
        store(&mut index, 1, StorageTier::Device, &blocks);
        store(&mut index, 2, StorageTier::Device, &blocks[..1]);
        index.remove_worker(1);
        assert_eq!(
            index.size(),
            IndexSize {
                nodes: 1,
                blocks: 1,
                workers: 1
            }
        );
        index.apply(2, StorageTier::Device, &KvEvent::Cleared);
        assert_eq!(index.size(), IndexSize::default());
        assert_eq!(lookup(&index, &blocks), vec![]);
    }

    #[test]
    fn removing_unknown_blocks_is_harmless() {
        let mut index = KvIndex::new();
        index.apply(
            1,
            StorageTier::Device,
            &KvEvent::Removed {
                block_hashes: vec![1, 2],
            },
        );
        let blocks = chain(&[1, 1]);
        store(&mut index, 1, StorageTier::Device, &blocks);
        store(&mut index, 1, StorageTier::Device, &blocks);
        index.apply(
            1,
            StorageTier::Host,
            &KvEvent::Removed {
                block_hashes: vec![blocks[0].block_hash],
            },
        );
        assert_eq!(
            index.size(),
            IndexSize {
                nodes: 1,
                blocks: 1,
                workers: 1
            }
        );
    }

    #[test]
    fn foreign_hashing_is_reported() {
        let mut index = KvIndex::new();
        let mut blocks = chain(&[1, 1, 2, 2]);
        blocks[1].tokens_hash ^= 1;
        assert_eq!(
            store(&mut index, 1, StorageTier::Device, &blocks),
            Some(Anomaly::HashMismatch)
        );
    }

    #[test]
    fn dumps_replace_a_workers_blocks() {
        let mut index = KvIndex::new();
        let old = chain(&[1, 1]);
        let new = chain(&[2, 2, 3, 3]);
        store(&mut index, 1, StorageTier::Device, &old);
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
}
