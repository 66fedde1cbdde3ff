//! The KV block pool of one engine: which physical blocks are in use, cached or free.
//!
//! Blocks are numbered `0..capacity`; a sequence's block table lists the numbers of its blocks,
//! which index the real engine's paged cache (the simulated engine only counts them). Full
//! blocks are named by their sequence hash (see [`switchyard_protocol::block_hash`]) and are shared between
//! sequences by reference count. A full block whose count drops to zero stays cached in an LRU
//! *inactive* pool, where a later request with the same prefix can take it back; a new
//! allocation with no free block evicts the least recently used inactive one. Blocks that are
//! still filling (prompt chunks in flight, the tail of a generation) are *anonymous*: private
//! to one sequence and never shared. Every change to the set of cached blocks is recorded as a
//! [`KvEvent`] (`stored`, `removed`, `cleared`), the events a real engine publishes, so the KV
//! index can follow this engine exactly.

use std::collections::HashMap;

use lru::LruCache;

use switchyard_protocol::block_hash::BlockHash;

pub use switchyard_protocol::kv_events::{KvEvent, StoredBlock};

/// A physical block number, `0..capacity`.
pub type BlockId = u32;

/// The block pool of one engine.
#[derive(Debug)]
pub struct BlockManager {
    capacity: usize,
    prefix_caching: bool,
    /// Blocks holding nothing, in the order they will be handed out (last first).
    free: Vec<BlockId>,
    /// Full blocks referenced by running sequences: hash → (block, references).
    active: HashMap<u64, (BlockId, usize)>,
    /// Full blocks no sequence references, least recently used first.
    inactive: LruCache<u64, BlockId>,
    anonymous: usize,
    events: Vec<KvEvent>,
}

impl BlockManager {
    /// A pool of `capacity` blocks. Without prefix caching, released blocks are freed at once.
    ///
    /// # Panics
    ///
    /// If `capacity` does not fit a [`BlockId`]; no engine has four billion blocks.
    pub fn new(capacity: usize, prefix_caching: bool) -> BlockManager {
        let top = BlockId::try_from(capacity).expect("block count fits in u32");
        BlockManager {
            capacity,
            prefix_caching,
            // Reversed so that blocks are handed out from 0 up, which keeps tests readable.
            free: (0..top).rev().collect(),
            active: HashMap::new(),
            inactive: LruCache::unbounded(),
            anonymous: 0,
            events: Vec::new(),
        }
    }

    /// Total blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks referenced by at least one running sequence (shared and anonymous).
    pub fn active_blocks(&self) -> usize {
        self.active.len() + self.anonymous
    }

    /// Cached blocks no sequence references (evictable).
    pub fn inactive_blocks(&self) -> usize {
        self.inactive.len()
    }

    /// Blocks a new allocation can obtain: free ones plus evictable cached ones.
    pub fn available(&self) -> usize {
        self.capacity - self.active_blocks()
    }

    /// Fraction of the pool referenced by running sequences.
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            return 1.0;
        }
        self.active_blocks() as f64 / self.capacity as f64
    }

    /// How many leading blocks of `hashes` are cached (referenced or inactive).
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        if !self.prefix_caching {
            return 0;
        }
        hashes
            .iter()
            .take_while(|hash| self.active.contains_key(&hash.sequence) || self.inactive.contains(&hash.sequence))
            .count()
    }

    /// How many leading blocks of `hashes` (sequence hashes) this pool holds, referenced or
    /// inactive, whether or not prefix caching is on: what it can export.
    pub fn held_run(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|hash| self.active.contains_key(hash) || self.inactive.contains(hash))
            .count()
    }

    /// The number of the block holding `hash`, if it is held; does not count as a use.
    pub fn block_of(&self, hash: u64) -> Option<BlockId> {
        self.active
            .get(&hash)
            .map(|(block, _)| *block)
            .or_else(|| self.inactive.peek(&hash).copied())
    }

    /// Whether a sequence can take the cached blocks `cached` and `new_blocks` fresh ones.
    pub fn can_admit(&self, cached: &[BlockHash], new_blocks: usize) -> bool {
        let revived = cached
            .iter()
            .filter(|hash| self.inactive.contains(&hash.sequence))
            .count();
        self.available() >= revived + new_blocks
    }

    /// Takes a reference on a cached block and returns its number, or `None` if it is not
    /// cached.
    pub fn acquire_cached(&mut self, hash: u64) -> Option<BlockId> {
        if let Some((block, count)) = self.active.get_mut(&hash) {
            *count += 1;
            return Some(*block);
        }
        let block = self.inactive.pop(&hash)?;
        self.active.insert(hash, (block, 1));
        Some(block)
    }

    /// Allocates one anonymous block, evicting the least recently used cached block if no
    /// block is free. Returns `None` if every block is referenced.
    pub fn allocate_anonymous(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(block) => block,
            None => {
                let (evicted, block) = self.inactive.pop_lru()?;
                self.events.push(KvEvent::Removed {
                    block_hashes: vec![evicted],
                });
                block
            }
        };
        self.anonymous += 1;
        Some(block)
    }

    /// Releases an anonymous block.
    pub fn release_anonymous(&mut self, block: BlockId) {
        debug_assert!(self.anonymous > 0, "released more anonymous blocks than allocated");
        self.anonymous = self.anonymous.saturating_sub(1);
        self.free.push(block);
    }

    /// Turns the caller's anonymous block `block` into the full block `hash`, now that its
    /// tokens are computed, and returns the block the caller holds from now on. If `hash` is
    /// already cached (another sequence computed the same prefix), the caller shares that block
    /// and `block` is freed: both hold the same keys and values.
    pub fn promote(&mut self, block: BlockId, parent: Option<u64>, hash: BlockHash) -> BlockId {
        if let Some(existing) = self.acquire_cached(hash.sequence) {
            self.release_anonymous(block);
            return existing;
        }
        self.anonymous = self.anonymous.saturating_sub(1);
        self.active.insert(hash.sequence, (block, 1));
        if self.prefix_caching {
            self.events.push(KvEvent::Stored {
                parent,
                blocks: vec![StoredBlock {
                    block_hash: hash.sequence,
                    tokens_hash: hash.local,
                }],
            });
        }
        block
    }

    /// Drops a reference on the full block `hash`; an unreferenced block stays cached (or is
    /// freed when prefix caching is off).
    pub fn release_full(&mut self, hash: u64) {
        let Some((block, count)) = self.active.get_mut(&hash) else {
            debug_assert!(false, "released a block that is not active");
            return;
        };
        *count -= 1;
        if *count == 0 {
            let block = *block;
            self.active.remove(&hash);
            if self.prefix_caching {
                self.inactive.put(hash, block);
            } else {
                self.free.push(block);
            }
        }
    }

    /// Drops every cached block no sequence references and returns how many. Announced as
    /// `cleared` when that empties the cache, else as `removed` for exactly those blocks (the
    /// ones running sequences hold stay cached, and the index must keep them).
    pub fn clear_cache(&mut self) -> usize {
        let mut dropped = Vec::with_capacity(self.inactive.len());
        while let Some((hash, block)) = self.inactive.pop_lru() {
            self.free.push(block);
            dropped.push(hash);
        }
        let count = dropped.len();
        if self.active.is_empty() {
            self.events.push(KvEvent::Cleared);
        } else if !dropped.is_empty() {
            self.events.push(KvEvent::Removed { block_hashes: dropped });
        }
        count
    }

    /// Takes the events recorded since the last call.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Sequence hashes of every cached block, referenced or not (for a resync dump).
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.active
            .keys()
            .chain(self.inactive.iter().map(|(hash, _)| hash))
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_protocol::block_hash::block_hashes;

    fn hashes(tokens: &[u32]) -> Vec<BlockHash> {
        block_hashes(tokens, 2)
    }

    fn store(manager: &mut BlockManager, chain: &[BlockHash]) -> Vec<BlockId> {
        let mut parent = None;
        let mut held = Vec::new();
        for hash in chain {
            let block = manager.allocate_anonymous().expect("a block is free");
            held.push(manager.promote(block, parent, *hash));
            parent = Some(hash.sequence);
        }
        held
    }

    #[test]
    fn shared_blocks_are_ref_counted_and_cached_after_release() {
        let mut manager = BlockManager::new(4, true);
        let chain = hashes(&[1, 2, 3, 4]);
        let held = store(&mut manager, &chain);
        assert_eq!(manager.acquire_cached(chain[0].sequence), Some(held[0]));
        assert_eq!(manager.active_blocks(), 2);
        manager.release_full(chain[0].sequence);
        assert_eq!(manager.active_blocks(), 2, "still referenced once");
        manager.release_full(chain[0].sequence);
        manager.release_full(chain[1].sequence);
        assert_eq!(manager.active_blocks(), 0);
        assert_eq!(manager.inactive_blocks(), 2);
        assert_eq!(manager.cached_prefix(&chain), 2);
        assert_eq!(
            manager.acquire_cached(chain[1].sequence),
            Some(held[1]),
            "revived in place"
        );
        let events = manager.drain_events();
        assert_eq!(events.len(), 2);
        assert!(matches!(&events[1], KvEvent::Stored { parent: Some(p), .. } if *p == chain[0].sequence));
    }

    #[test]
    fn allocation_evicts_least_recently_used_and_reuses_its_block() {
        let mut manager = BlockManager::new(2, true);
        let a = hashes(&[1, 1]);
        let b = hashes(&[2, 2]);
        let held_a = store(&mut manager, &a);
        store(&mut manager, &b);
        manager.release_full(a[0].sequence);
        manager.release_full(b[0].sequence);
        manager.drain_events();
        assert_eq!(manager.allocate_anonymous(), Some(held_a[0]), "a's block is reused");
        assert_eq!(
            manager.drain_events(),
            vec![KvEvent::Removed {
                block_hashes: vec![a[0].sequence]
            }]
        );
        assert_eq!(manager.cached_prefix(&b), 1);
        assert!(manager.allocate_anonymous().is_some());
        assert!(manager.allocate_anonymous().is_none(), "everything is referenced");
    }

    #[test]
    fn duplicate_promotion_shares_the_existing_block_and_frees_the_copy() {
        let mut manager = BlockManager::new(4, true);
        let chain = hashes(&[7, 7]);
        let first = store(&mut manager, &chain);
        let second = store(&mut manager, &chain);
        assert_eq!(first, second, "the second sequence holds the first one's block");
        assert_eq!(manager.active_blocks(), 1);
        assert_eq!(manager.available(), 3, "the duplicate went back to the free list");
        assert_eq!(manager.drain_events().len(), 1, "only a fresh store is reported");
    }

    #[test]
    fn every_block_number_is_handed_out_once() {
        let mut manager = BlockManager::new(8, true);
        let mut seen = std::collections::HashSet::new();
        while let Some(block) = manager.allocate_anonymous() {
            assert!(block < 8 && seen.insert(block), "block {block} handed out twice");
        }
        assert_eq!(seen.len(), 8);
    }

    #[test]
    fn clearing_drops_unreferenced_blocks_and_says_exactly_which() {
        let mut manager = BlockManager::new(8, true);
        let a = hashes(&[1, 2, 3, 4]);
        let b = hashes(&[5, 6]);
        store(&mut manager, &a);
        store(&mut manager, &b);
        manager.release_full(a[0].sequence);
        manager.release_full(a[1].sequence);
        manager.drain_events();
        // b is still referenced: only a's blocks go, named one by one.
        assert_eq!(manager.clear_cache(), 2);
        match manager.drain_events().as_slice() {
            [KvEvent::Removed { block_hashes }] => {
                assert_eq!(block_hashes.len(), 2);
                assert!(block_hashes.contains(&a[0].sequence) && block_hashes.contains(&a[1].sequence));
            }
            other => panic!("expected one removed event, got {other:?}"),
        }
        assert_eq!(manager.cached_prefix(&b), 1);
        manager.release_full(b[0].sequence);
        assert_eq!(manager.clear_cache(), 1);
        assert_eq!(manager.drain_events(), vec![KvEvent::Cleared], "now the cache is empty");
        assert_eq!(manager.available(), 8);
    }

    #[test]
    fn the_held_run_stops_at_the_first_block_not_held() {
        let mut manager = BlockManager::new(8, true);
        let chain = hashes(&[1, 2, 3, 4, 5, 6]);
        let held = store(&mut manager, &chain[..2]);
        manager.release_full(chain[0].sequence);
        let sequences: Vec<u64> = chain.iter().map(|hash| hash.sequence).collect();
        assert_eq!(
            manager.held_run(&sequences),
            2,
            "one inactive, one referenced, then a gap"
        );
        assert_eq!(manager.held_run(&sequences[1..]), 1);
        assert_eq!(manager.held_run(&sequences[2..]), 0);
        assert_eq!(manager.block_of(chain[0].sequence), Some(held[0]));
        assert_eq!(manager.block_of(chain[1].sequence), Some(held[1]));
        assert_eq!(manager.block_of(chain[2].sequence), None);
    }

    #[test]
    fn without_prefix_caching_nothing_is_kept() {
        let mut manager = BlockManager::new(4, false);
        let chain = hashes(&[1, 2]);
        store(&mut manager, &chain);
        manager.release_full(chain[0].sequence);
        assert_eq!(manager.inactive_blocks(), 0);
        assert_eq!(manager.available(), 4);
        assert_eq!(manager.cached_prefix(&chain), 0);
        assert!(manager.drain_events().is_empty());
    }
}
