//! An approximate prefix index: which worker was sent which prompt blocks, as a router
//! remembers its own decisions.
//!
//! The gateway tells a router what each worker holds (the `overlap` columns, from the engines'
//! KV events). Routers of other gateways cannot see that and keep their own record instead:
//! SGLang's router an approximate radix tree per worker, llm-d's and AIBrix's an index of
//! prompt-block hashes, each filled with the prompts the router itself sent and trimmed by
//! least-recent use. [`PrefixIndex`] is that record over the prompt's chained block hashes
//! (the `prompt` import): since hash `i` names the whole prefix up to block `i`, a map from
//! hash to the workers it was sent to is a radix tree over blocks. Entries beyond a capacity
//! (per worker, as llm-d and SGLang bound theirs, or in all, as AIBrix does) are evicted least
//! recently used first.
//!
//! It lives in the policy instance, so it starts empty whenever the gateway instantiates the
//! policy afresh, and each gateway thread's instance sees only the requests that thread routed
//! (as each replica of those routers sees only its own); see the contract's note on state.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

/// Where prompts went: (block hash, worker id) → when it was last sent there, with
/// least-recently-used eviction per worker or over all workers.
///
/// About 80 bytes an entry (two B-tree entries), so a policy under the gateway's default
/// 32 MiB sandbox keeps a few hundred thousand blocks: [`PrefixIndex::MEMORY_BLOCKS`].
#[derive(Debug, Default)]
pub struct PrefixIndex {
    /// Each (hash, worker) entry and its stamp.
    holders: BTreeMap<(u64, u32), u64>,
    /// The entries by age: (worker id, stamp, hash) for per-worker eviction, or (0, stamp,
    /// hash · worker) ordering for shared eviction (see `shared`).
    ages: BTreeSet<(u32, u64, u64, u32)>,
    /// Entries per worker.
    counts: BTreeMap<u32, usize>,
    /// Advances once per insert.
    clock: u64,
    /// Most entries kept per worker, or in all (see `shared`).
    capacity: usize,
    /// Whether `capacity` bounds all workers' entries together.
    shared: bool,
}

impl PrefixIndex {
    /// Blocks an index can hold within a policy's default 32 MiB memory, with room for the
    /// call's own data: the most a router should configure over all workers.
    pub const MEMORY_BLOCKS: usize = 200_000;

    /// An empty index keeping at most `capacity` blocks per worker.
    pub fn new(capacity: usize) -> PrefixIndex {
        PrefixIndex {
            capacity: capacity.max(1),
            ..PrefixIndex::default()
        }
    }

    /// An empty index keeping at most `capacity` blocks over all workers together.
    pub fn shared(capacity: usize) -> PrefixIndex {
        PrefixIndex {
            capacity: capacity.max(1),
            shared: true,
            ..PrefixIndex::default()
        }
    }

    /// Changes the capacity (entries past it go at the next insert).
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
    }

    /// Entries over all workers.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    /// Whether the index holds nothing.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// For each worker holding the first block of `hashes`, how many leading blocks it holds
    /// (consecutive from the first), in ascending worker id order.
    pub fn matches(&self, hashes: &[u64]) -> Vec<(u32, u32)> {
        let holders_of = |hash: u64| {
            self.holders
                .range((hash, 0)..=(hash, u32::MAX))
                .map(|(&(_, worker), _)| worker)
        };
        let Some(&first) = hashes.first() else {
            return Vec::new();
        };
        // Ascending worker ids, from the key order.
        let mut matched: Vec<(u32, u32)> = holders_of(first).map(|worker| (worker, 1)).collect();
        // Workers still matching; each block narrows them down.
        let mut live: Vec<usize> = (0..matched.len()).collect();
        for &hash in &hashes[1..] {
            if live.is_empty() {
                break;
            }
            live.retain(|&slot| self.holders.contains_key(&(hash, matched[slot].0)));
            for &slot in &live {
                matched[slot].1 += 1;
            }
        }
        matched
    }

    /// Blocks in the index for `worker`.
    pub fn size(&self, worker: u32) -> usize {
        self.counts.get(&worker).copied().unwrap_or(0)
    }

    /// The age key of an entry: per worker, or one order over all.
    fn age(&self, worker: u32, stamp: u64, hash: u64) -> (u32, u64, u64, u32) {
        if self.shared {
            (0, stamp, hash, worker)
        } else {
            (worker, stamp, hash, 0)
        }
    }

    /// Records that `hashes` were sent to `worker` (refreshing the ones it had), then evicts
    /// the least recently used entries past the capacity.
    pub fn insert(&mut self, hashes: &[u64], worker: u32) {
        for &hash in hashes {
            self.clock += 1;
            let stamp = self.clock;
            match self.holders.insert((hash, worker), stamp) {
                Some(last) => {
                    let old = self.age(worker, last, hash);
                    self.ages.remove(&old);
                }
                None => *self.counts.entry(worker).or_default() += 1,
            }
            let age = self.age(worker, stamp, hash);
            self.ages.insert(age);
        }
        let over = |index: &PrefixIndex| {
            if index.shared {
                index.len() > index.capacity
            } else {
                index.size(worker) > index.capacity
            }
        };
        while over(self) {
            let scope = if self.shared { 0 } else { worker };
            let Some(&(_, stamp, hash, holder)) = self
                .ages
                .range((scope, 0, 0, 0)..=(scope, u64::MAX, u64::MAX, u32::MAX))
                .next()
            else {
                break;
            };
            let owner = if self.shared { holder } else { worker };
            let age = self.age(owner, stamp, hash);
            self.ages.remove(&age);
            self.holders.remove(&(hash, owner));
            if let Some(count) = self.counts.get_mut(&owner) {
                *count = count.saturating_sub(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_count_leading_blocks_and_eviction_drops_the_oldest() {
        let mut index = PrefixIndex::new(4);
        index.insert(&[1, 2, 3], 7);
        index.insert(&[1, 2, 9], 5);
        assert_eq!(index.matches(&[1, 2, 3, 4]), [(5, 2), (7, 3)]);
        assert_eq!(index.matches(&[20, 3]), []);
        assert_eq!((index.size(7), index.size(5)), (3, 3));
        // Worker 7 at capacity 4: a fifth block evicts its oldest, block 1, so nothing of its
        // prefix matches from the start any more.
        index.insert(&[10, 11], 7);
        assert_eq!(index.size(7), 4);
        assert_eq!(index.matches(&[1, 2, 3]), [(5, 2)]);
        // Sending a block again refreshes it: three more blocks evict 2, 3 and 11, not 10.
        index.insert(&[10], 7);
        index.insert(&[12, 13, 14], 7);
        assert_eq!(index.matches(&[10, 11]), [(7, 1)]);
        assert_eq!(index.size(7), 4);
    }

    #[test]
    fn a_shared_capacity_evicts_the_oldest_of_any_worker() {
        let mut index = PrefixIndex::shared(3);
        index.insert(&[1, 2], 1);
        index.insert(&[1, 5], 2);
        assert_eq!((index.len(), index.size(1), index.size(2)), (3, 1, 2));
        assert_eq!(index.matches(&[1, 2]), [(2, 1)]);
        assert_eq!(index.matches(&[1, 5]), [(2, 2)]);
    }
}
