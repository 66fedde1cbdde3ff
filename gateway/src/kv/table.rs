//! One shard of the prefix index: an open-addressed table from block hash to holders.
//!
//! The index is bound by cache misses: every event and lookup touches one node per block, and
//! the nodes of a fleet's caches are far larger than the CPU's caches. This table keeps a node
//! in one 16-byte slot (the block hash, and its holder when it has only one, as most nodes do),
//! placed by its hash alone: finding it costs one cache line, and the index can prefetch the
//! slots of a request's next blocks while it works on this one ([`SlotsHint`]). `HashMap` reads
//! a control group and then a bucket, two dependent misses, and offers no way to prefetch.
//!
//! Layout: linear probing from the home slot (the hash's low bits), the table at most 3/4 full,
//! removal by backward shift (no tombstones, so a probe ends at the first empty slot). A node
//! with several holders keeps them sorted in a side list (`spills`), which the slot points to.
//! Holder entries are `worker << 1 | tier`, so worker ids must stay below 2^31 (the pool counts
//! them up from 0); the entry of the last one on host, `u32::MAX`, marks an empty slot and is
//! refused.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use super::index::KeyedState;

/// The holder entry of an empty slot (worker 2^31 - 1 on host, never assigned).
const VACANT: u32 = u32::MAX;

/// Fewest slots a table that holds anything has.
const MIN_SLOTS: usize = 16;

/// A node: its block hash and its holder, or (`spill > 0`) the index + 1 of its holder list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(16))]
pub(super) struct Slot {
    key: u64,
    holder: u32,
    spill: u32,
}

impl Slot {
    const EMPTY: Slot = Slot {
        key: 0,
        holder: VACANT,
        spill: 0,
    };

    fn is_empty(&self) -> bool {
        self.spill == 0 && self.holder == VACANT
    }
}

/// What adding a holding changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Added {
    /// Nothing: the worker already held the block on that tier.
    Nothing,
    /// A holding on an existing node.
    Holding,
    /// A new node, with this holding its only one.
    Node,
}

/// What dropping a holding changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dropped {
    /// Nothing: no such node, or the worker did not hold it on that tier.
    Nothing,
    /// A holding; the node has others.
    Holding,
    /// The node's last holding, and with it the node.
    Node,
}

/// One shard's nodes; see the module documentation.
#[derive(Debug, Default)]
pub(super) struct NodeTable {
    /// A power of two long, or empty.
    slots: Box<[Slot]>,
    /// Occupied slots.
    len: usize,
    /// Holder lists of nodes with several holders, sorted, each at least two long.
    spills: Vec<Vec<u32>>,
    /// Unused entries of `spills` (left empty).
    free_spills: Vec<u32>,
}

impl NodeTable {
    /// Nodes in the table.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Whether the table holds no node.
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    fn find(&self, hash: u64, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = hash as usize & mask;
        loop {
            let slot = &self.slots[i];
            if slot.is_empty() {
                return None;
            }
            if slot.key == key {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    fn holders_of<'a>(&'a self, slot: &'a Slot) -> &'a [u32] {
        if slot.spill == 0 {
            std::slice::from_ref(&slot.holder)
        } else {
            &self.spills[slot.spill as usize - 1]
        }
    }

    /// The sorted holder entries of the node `key` (whose keyed hash is `hash`), if any.
    pub(super) fn holders(&self, hash: u64, key: u64) -> Option<&[u32]> {
        let i = self.find(hash, key)?;
        Some(self.holders_of(&self.slots[i]))
    }

    /// Adds holder `entry` to the node `key`, creating the node if new.
    pub(super) fn add(&mut self, keyed: &KeyedState, hash: u64, key: u64, entry: u32) -> Added {
        if entry == VACANT {
            // Worker 2^31 - 1 on host: never assigned (ids count up from 0), and stored it would
            // read as an empty slot and break the probes that cross it.
            return Added::Nothing;
        }
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow(keyed);
        }
        let mask = self.mask();
        let mut i = hash as usize & mask;
        loop {
            let slot = self.slots[i];
            if slot.is_empty() {
                self.slots[i] = Slot {
                    key,
                    holder: entry,
                    spill: 0,
                };
                self.len += 1;
                return Added::Node;
            }
            if slot.key == key {
                return self.add_to(i, entry);
            }
            i = (i + 1) & mask;
        }
    }

    fn add_to(&mut self, i: usize, entry: u32) -> Added {
        let slot = self.slots[i];
        if slot.spill != 0 {
            let list = &mut self.spills[slot.spill as usize - 1];
            return match list.binary_search(&entry) {
                Ok(_) => Added::Nothing,
                Err(position) => {
                    list.insert(position, entry);
                    Added::Holding
                }
            };
        }
        if slot.holder == entry {
            return Added::Nothing;
        }
        let pair = if slot.holder < entry {
            vec![slot.holder, entry]
        } else {
            vec![entry, slot.holder]
        };
        let spill = self.new_spill(pair);
        self.slots[i] = Slot {
            key: slot.key,
            holder: 0,
            spill,
        };
        Added::Holding
    }

    fn new_spill(&mut self, list: Vec<u32>) -> u32 {
        match self.free_spills.pop() {
            Some(free) => {
                self.spills[free as usize] = list;
                free + 1
            }
            None => {
                self.spills.push(list);
                // At most one list per node, and a shard's nodes are far fewer than 2^32.
                self.spills.len() as u32
            }
        }
    }

    /// Drops holder `entry` from the node `key`, and the node with its last holder.
    pub(super) fn remove(&mut self, keyed: &KeyedState, hash: u64, key: u64, entry: u32) -> Dropped {
        let Some(i) = self.find(hash, key) else {
            return Dropped::Nothing;
        };
        let slot = self.slots[i];
        if slot.spill == 0 {
            if slot.holder != entry {
                return Dropped::Nothing;
            }
            self.vacate(keyed, i);
            return Dropped::Node;
        }
        let index = slot.spill as usize - 1;
        let list = &mut self.spills[index];
        let Ok(position) = list.binary_search(&entry) else {
            return Dropped::Nothing;
        };
        list.remove(position);
        if let [last] = list[..] {
            self.spills[index] = Vec::new();
            self.free_spills.push(slot.spill - 1);
            self.slots[i] = Slot {
                key,
                holder: last,
                spill: 0,
            };
        }
        Dropped::Holding
    }

    /// Empties slot `i`, shifting back the run after it so that no probe crosses a hole.
    fn vacate(&mut self, keyed: &KeyedState, i: usize) {
        let mask = self.mask();
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let slot = self.slots[j];
            if slot.is_empty() {
                break;
            }
            let home = keyed.hash_one(slot.key) as usize & mask;
            // The slot may fill the hole if the hole lies on its probe path (home ..= j).
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.slots[hole] = slot;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = Slot::EMPTY;
        self.len -= 1;
    }

    fn grow(&mut self, keyed: &KeyedState) {
        let size = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![Slot::EMPTY; size].into_boxed_slice());
        let mask = self.mask();
        for slot in old.iter().filter(|slot| !slot.is_empty()) {
            let mut i = keyed.hash_one(slot.key) as usize & mask;
            while !self.slots[i].is_empty() {
                i = (i + 1) & mask;
            }
            self.slots[i] = *slot;
        }
    }

    /// Keeps the holder entries `keep` accepts (called with a node's block hash and one of its
    /// entries), dropping nodes left without one; returns the holdings and nodes dropped.
    /// Rebuilds the table at the size its survivors need.
    pub(super) fn retain(&mut self, keyed: &KeyedState, mut keep: impl FnMut(u64, u32) -> bool) -> (usize, usize) {
        let old = std::mem::take(self);
        let (mut holdings, mut nodes) = (0, 0);
        let mut survivors = Vec::new();
        for slot in old.slots.iter().filter(|slot| !slot.is_empty()) {
            let mut list = old.holders_of(slot).to_vec();
            let before = list.len();
            list.retain(|&entry| keep(slot.key, entry));
            holdings += before - list.len();
            if list.is_empty() {
                nodes += 1;
            } else {
                survivors.push((slot.key, list));
            }
        }
        for (key, list) in survivors {
            let hash = keyed.hash_one(key);
            for entry in list {
                self.add(keyed, hash, key, entry);
            }
        }
        (holdings, nodes)
    }

    /// Heap bytes the table holds.
    pub(super) fn heap_bytes(&self) -> usize {
        self.slots.len() * size_of::<Slot>()
            + self.spills.capacity() * size_of::<Vec<u32>>()
            + self.spills.iter().map(|list| list.capacity() * 4).sum::<usize>()
            + self.free_spills.capacity() * 4
    }

    /// Every node's holders, for checks.
    #[cfg(test)]
    pub(super) fn nodes(&self) -> impl Iterator<Item = (u64, &[u32])> {
        self.slots
            .iter()
            .filter(|slot| !slot.is_empty())
            .map(|slot| (slot.key, self.holders_of(slot)))
    }
}

/// Where a table's slots are, readable without its lock, so that the index can prefetch a
/// block's slot before it takes the lock. Updated under the write lock whenever the table
/// reallocates; a stale hint costs a useless prefetch, never a wrong answer (a prefetch does not
/// fault and changes nothing).
#[derive(Debug, Default)]
pub(super) struct SlotsHint {
    base: AtomicPtr<Slot>,
    mask: AtomicUsize,
}

impl SlotsHint {
    /// Records where `table`'s slots are now, if they moved.
    pub(super) fn update(&self, table: &NodeTable) {
        let (base, mask) = if table.slots.is_empty() {
            (std::ptr::null_mut(), 0)
        } else {
            (table.slots.as_ptr().cast_mut(), table.mask())
        };
        if self.base.load(Ordering::Relaxed) != base || self.mask.load(Ordering::Relaxed) != mask {
            self.base.store(base, Ordering::Relaxed);
            self.mask.store(mask, Ordering::Relaxed);
        }
    }

    /// Asks the CPU to bring the home slot of `hash` into cache.
    pub(super) fn prefetch(&self, hash: u64) {
        let base = self.base.load(Ordering::Relaxed);
        if base.is_null() {
            return;
        }
        let slot = base.wrapping_add(hash as usize & self.mask.load(Ordering::Relaxed));
        prefetch(slot);
    }
}

/// Asks the CPU to bring the cache line at `address` into cache.
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch<T>(address: *const T) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    // SAFETY: a prefetch is a hint: it reads nothing the program sees and does not fault,
    // whatever the address (a stale hint may point into freed memory).
    unsafe { _mm_prefetch::<_MM_HINT_T0>(address.cast()) };
}

/// Asks the CPU to bring the cache line at `address` into cache (a no-op off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn prefetch<T>(_address: *const T) {}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    /// A table and a model of it, changed together and compared.
    struct Checked {
        keyed: KeyedState,
        table: NodeTable,
        model: BTreeMap<u64, BTreeSet<u32>>,
    }

    impl Checked {
        fn new() -> Checked {
            Checked {
                keyed: KeyedState::default(),
                table: NodeTable::default(),
                model: BTreeMap::new(),
            }
        }

        fn add(&mut self, key: u64, entry: u32) {
            let holders = self.model.entry(key).or_default();
            let expected = match (holders.is_empty(), holders.insert(entry)) {
                (true, _) => Added::Node,
                (false, true) => Added::Holding,
                (false, false) => Added::Nothing,
            };
            let hash = self.keyed.hash_one(key);
            assert_eq!(
                self.table.add(&self.keyed, hash, key, entry),
                expected,
                "add {key} {entry}"
            );
        }

        fn remove(&mut self, key: u64, entry: u32) {
            let held = self.model.get_mut(&key).is_some_and(|holders| holders.remove(&entry));
            let expected = match self.model.get(&key) {
                _ if !held => Dropped::Nothing,
                Some(holders) if holders.is_empty() => {
                    self.model.remove(&key);
                    Dropped::Node
                }
                _ => Dropped::Holding,
            };
            let hash = self.keyed.hash_one(key);
            assert_eq!(
                self.table.remove(&self.keyed, hash, key, entry),
                expected,
                "remove {key} {entry}"
            );
        }

        fn check(&self) {
            assert_eq!(self.table.len(), self.model.len());
            for (key, holders) in &self.model {
                let found = self.table.holders(self.keyed.hash_one(*key), *key);
                let expected: Vec<u32> = holders.iter().copied().collect();
                assert_eq!(found, Some(&expected[..]), "holders of {key}");
            }
            let listed: BTreeSet<u64> = self.table.nodes().map(|(key, _)| key).collect();
            assert_eq!(listed, self.model.keys().copied().collect());
            let spilled = self.table.spills.iter().filter(|list| !list.is_empty()).count();
            let multi = self.model.values().filter(|holders| holders.len() > 1).count();
            assert_eq!(spilled, multi, "a holder list leaked or was lost");
        }
    }

    #[test]
    fn random_adds_and_removes_match_a_model() {
        // Few keys and entries, so that nodes gain and lose holders, spill and unspill, and
        // removals shift runs that wrap around the end of the table.
        let mut checked = Checked::new();
        let mut state = 0x1234_5678_9abc_def0_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..20_000 {
            let r = next();
            let key = r % 300;
            let entry = ((r >> 20) % 6) as u32;
            if (r >> 40) % 5 < 3 {
                checked.add(key, entry);
            } else {
                checked.remove(key, entry);
            }
            if round % 1_000 == 0 {
                checked.check();
            }
        }
        checked.check();
        for key in 0..300 {
            for entry in 0..6 {
                checked.remove(key, entry);
            }
        }
        checked.check();
        assert!(checked.table.is_empty());
    }

    #[test]
    fn retain_drops_a_workers_entries_and_emptied_nodes() {
        let mut checked = Checked::new();
        for key in 0..100 {
            checked.add(key, 2);
            if key % 3 == 0 {
                checked.add(key, 4);
            }
        }
        let (holdings, nodes) = checked.table.retain(&checked.keyed, |_, entry| entry != 2);
        assert_eq!((holdings, nodes), (100, 66));
        checked.model.retain(|_, holders| {
            holders.remove(&2);
            !holders.is_empty()
        });
        checked.check();
    }

    #[test]
    fn the_entry_that_marks_empty_slots_is_refused() {
        let keyed = KeyedState::default();
        let mut table = NodeTable::default();
        assert_eq!(table.add(&keyed, keyed.hash_one(7), 7, VACANT), Added::Nothing);
        assert!(table.is_empty());
        assert_eq!(table.holders(keyed.hash_one(7), 7), None);
    }

    #[test]
    fn a_key_of_zero_is_a_key_like_any_other() {
        let mut checked = Checked::new();
        checked.add(0, 0);
        checked.add(16, 1);
        checked.check();
        checked.remove(0, 0);
        checked.check();
    }
}
