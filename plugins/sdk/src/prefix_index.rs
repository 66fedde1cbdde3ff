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

/// Where prompts went: block hash → the workers (by id) it was sent to, with per-worker
/// least-recently-used eviction.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    /// Each hash's holders: (worker id, when it was last sent there).
    holders: BTreeMap<u64, Vec<(u32, u64)>>,
    /// Each worker's entries by age: (worker id, stamp, hash).
    ages: BTreeSet<(u32, u64, u64)>,
    /// Every entry by age, when the capacity is for all workers together: (stamp, worker, hash).
    all_ages: BTreeSet<(u64, u32, u64)>,
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

    /// Entries over all workers.
    pub fn len(&self) -> usize {
        self.counts.values().sum()
    }

    /// Whether the index holds nothing.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// For each worker holding the first block of `hashes`, how many leading blocks it holds
    /// (consecutive from the first), in ascending worker id order.
    pub fn matches(&self, hashes: &[u64]) -> Vec<(u32, u32)> {
        let Some(first) = hashes.first().and_then(|hash| self.holders.get(hash)) else {
            return Vec::new();
        };
        let mut matched: Vec<(u32, u32)> = first.iter().map(|&(worker, _)| (worker, 1)).collect();
        matched.sort_unstable();
        // Workers still matching at block `depth`; each block narrows them down.
        let mut live: Vec<usize> = (0..matched.len()).collect();
        for hash in &hashes[1..] {
            let Some(holders) = self.holders.get(hash) else {
                break;
            };
            live.retain(|&slot| holders.iter().any(|&(worker, _)| worker == matched[slot].0));
            if live.is_empty() {
                break;
            }
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

    /// Records that `hashes` were sent to `worker` (refreshing the ones it had), then evicts
    /// that worker's least recently used entries past the capacity.
    pub fn insert(&mut self, hashes: &[u64], worker: u32) {
        for &hash in hashes {
            self.clock += 1;
            let stamp = self.clock;
            let holders = self.holders.entry(hash).or_default();
            match holders.iter_mut().find(|(holder, _)| *holder == worker) {
                Some((_, last)) => {
                    self.ages.remove(&(worker, *last, hash));
                    self.all_ages.remove(&(*last, worker, hash));
                    *last = stamp;
                }
                None => {
                    holders.push((worker, stamp));
                    *self.counts.entry(worker).or_default() += 1;
                }
            }
            self.ages.insert((worker, stamp, hash));
            if self.shared {
                self.all_ages.insert((stamp, worker, hash));
            }
        }
        if self.shared {
            while self.all_ages.len() > self.capacity {
                let Some(&(stamp, holder, hash)) = self.all_ages.first() else {
                    break;
                };
                self.evict((holder, stamp, hash));
            }
            return;
        }
        while self.size(worker) > self.capacity {
            let Some(&oldest) = self.ages.range((worker, 0, 0)..=(worker, u64::MAX, u64::MAX)).next() else {
                break;
            };
            self.evict(oldest);
        }
    }

    /// Forgets one (worker, stamp, hash) entry.
    fn evict(&mut self, (worker, stamp, hash): (u32, u64, u64)) {
        self.ages.remove(&(worker, stamp, hash));
        self.all_ages.remove(&(stamp, worker, hash));
        if let Some(holders) = self.holders.get_mut(&hash) {
            holders.retain(|(holder, _)| *holder != worker);
            if holders.is_empty() {
                self.holders.remove(&hash);
            }
        }
        if let Some(count) = self.counts.get_mut(&worker) {
            *count = count.saturating_sub(1);
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
