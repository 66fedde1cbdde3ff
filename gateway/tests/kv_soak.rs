//! Soak test: the prefix index's memory stays bounded under long store/remove churn.
//!
//! 10^7 random `Stored` / `Removed` events from 64 workers, each a short run of blocks of one
//! chain drawn from a bounded universe: a 4-ary tree of block chains 7 blocks deep (4,096
//! chains, 5,461 distinct blocks). A run ends at the chain's last block 3 times in 4 (else at a
//! random earlier block) and starts at a random block before its end, so every block, leaves
//! included, is touched often enough for the index to reach its steady state within the first
//! 10^6 events. Stores and removes are equally likely and draw from the same distribution, so
//! at the steady state each (worker, block) is held half of the time. A counting global
//! allocator tracks live heap bytes.
//!
//! What is asserted about memory: the live heap after all 10^7 events is at most 1.25x the
//! level after the first 10^6 (the steady state; hash tables may still grow once while their
//! deleted slots are recycled), never more than that at any point after warmup, and flat over
//! the second half of the run (at most 1.05x the level at 5 x 10^6): a leak of more than ~0.01
//! byte per event would show there. Emptying the index frees its tables.
//!
//! The test's own report lines are kept in a buffer reserved before the first measurement and
//! printed when the test ends (or panics): printed as they come, they would grow the test
//! harness's output-capture buffer, which the counting allocator sees like any other heap.

use std::fmt::Write as _;
use std::time::Instant;

use switchyard::bench::{IndexSize, KvIndex};
use switchyard_harness::heap::live;
use switchyard_harness::rng::SplitMix64;
use switchyard_protocol::block_hash::{HASH_SEED, chain_hash};
use switchyard_protocol::kv_events::{KvEvent, StorageTier, StoredBlock};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Counts this process's live heap: the test measures the index's memory with it, so this
/// binary holds no other test.
#[global_allocator]
static HEAP: switchyard_harness::heap::Counting = switchyard_harness::heap::Counting;

const EVENTS: u64 = 10_000_000;
const WARMUP: u64 = 1_000_000;
const MIDPOINT: u64 = 5_000_000;
const CHECK_EVERY: u64 = 100_000;
const WORKERS: u32 = 64;
/// Blocks per chain.
const DEPTH: usize = 7;
/// Chains: leaves of a 4-ary tree of depth 7 (block `i` of chain `c` is node `c >> 2(6-i)`).
const CHAINS: u64 = 1 << (2 * (DEPTH - 1));

/// The universe: per depth, per node at that depth, (sequence hash, local hash).
fn universe() -> Vec<Vec<(u64, u64)>> {
    let mut levels: Vec<Vec<(u64, u64)>> = Vec::with_capacity(DEPTH);
    for depth in 0..DEPTH {
        let nodes = 1u64 << (2 * depth);
        let level = (0..nodes)
            .map(|node| {
                let local = xxh3_64_with_seed(&(((depth as u64) << 32) | node).to_le_bytes(), HASH_SEED);
                let parent = depth.checked_sub(1).map(|d| levels[d][(node >> 2) as usize].0);
                (chain_hash(parent, local), local)
            })
            .collect();
        levels.push(level);
    }
    levels
}

fn block(levels: &[Vec<(u64, u64)>], chain: u64, depth: usize) -> (u64, u64) {
    levels[depth][(chain >> (2 * (DEPTH - 1 - depth))) as usize]
}

/// Report lines, written to stdout when dropped: at the end of the test or while a failed
/// assertion unwinds.
struct Report(String);

impl Report {
    /// Room for every line the test writes, so writing them never allocates mid-measurement.
    const CAPACITY: usize = 64 * 1024;

    fn new() -> Self {
        Report(String::with_capacity(Self::CAPACITY))
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        print!("{}", self.0);
    }
}

/// Appends one line to the report.
macro_rules! report {
    ($report:expr, $($arg:tt)*) => {{
        // Writing to a `String` cannot fail.
        let _ = writeln!($report.0, $($arg)*);
    }};
}

#[test]
fn index_memory_stays_bounded_under_churn() {
    let levels = universe();
    let universe_blocks: usize = levels.iter().map(Vec::len).sum();
    assert_eq!(universe_blocks, 5_461);
    let max_holdings = universe_blocks * WORKERS as usize;

    let mut rng = SplitMix64::new(0x5EED);
    let mut report = Report::new();
    let start_live = live();
    let index = KvIndex::new();
    // The empty index's own footprint: its table locks, one per shard, allocated up front.
    let empty_bytes = live() - start_live;
    let started = Instant::now();
    let mut warm_bytes = 0usize;
    let mut mid_bytes = 0usize;
    let mut peak_bytes = 0usize;
    let mut peak_size = IndexSize::default();
    let (mut stored_blocks, mut removed_blocks) = (0u64, 0u64);

    for event_no in 1..=EVENTS {
        let worker = rng.below(u64::from(WORKERS)) as u32;
        let chain = rng.below(CHAINS);
        // A short run [from, to) of the chain, 1 to 7 blocks, mostly ending at its last block.
        let to = if rng.below(4) < 3 {
            DEPTH
        } else {
            1 + rng.below(DEPTH as u64 - 1) as usize
        };
        let from = rng.below(to as u64) as usize;
        let event = if rng.next() & 1 == 0 {
            stored_blocks += (to - from) as u64;
            KvEvent::Stored {
                parent: from.checked_sub(1).map(|d| block(&levels, chain, d).0),
                blocks: (from..to)
                    .map(|d| {
                        let (block_hash, tokens_hash) = block(&levels, chain, d);
                        StoredBlock {
                            block_hash,
                            tokens_hash,
                        }
                    })
                    .collect(),
            }
        } else {
            removed_blocks += (to - from) as u64;
            KvEvent::Removed {
                // Leaves first, as engines evict.
                block_hashes: (from..to).rev().map(|d| block(&levels, chain, d).0).collect(),
            }
        };
        assert_eq!(index.apply(worker, StorageTier::Device, &event), None);
        drop(event);

        if event_no % CHECK_EVERY == 0 {
            let size = index.size();
            assert!(size.nodes <= universe_blocks, "{size:?} exceeds the universe");
            assert!(size.blocks <= max_holdings, "{size:?} exceeds the universe");
            assert!(size.workers <= WORKERS as usize, "{size:?}");
            assert!(size.blocks >= size.nodes);
            let bytes = live() - start_live;
            peak_bytes = peak_bytes.max(bytes);
            if size.blocks > peak_size.blocks {
                peak_size = size;
            }
            if event_no == WARMUP {
                warm_bytes = bytes;
            }
            if event_no == MIDPOINT {
                mid_bytes = bytes;
            }
            if event_no % 1_000_000 == 0 {
                report!(
                    report,
                    "after {:>8} events ({:>5.1} s): live index heap {:>9} B ({:.3}x warm), heap_bytes() {:>9} B, {:?}",
                    event_no,
                    started.elapsed().as_secs_f64(),
                    bytes,
                    bytes as f64 / warm_bytes as f64,
                    index.heap_bytes(),
                    size
                );
            }
            if event_no > WARMUP {
                assert!(
                    bytes * 4 <= warm_bytes * 5,
                    "live heap {bytes} B after {event_no} events exceeds 1.25x the {warm_bytes} B after warmup"
                );
            }
            if event_no > MIDPOINT {
                assert!(
                    bytes * 100 <= mid_bytes * 105,
                    "live heap {bytes} B after {event_no} events grew past 1.05x the {mid_bytes} B at {MIDPOINT}"
                );
            }
        }
    }
    let churn_time = started.elapsed();
    let final_bytes = live() - start_live;
    let final_size = index.size();
    report!(
        report,
        "{EVENTS} events in {:.1} s ({:.0} events/s): {stored_blocks} blocks stored, {removed_blocks} removed; \
         final live heap {final_bytes} B = {:.3}x the {warm_bytes} B after {WARMUP} events, {:.3}x the {mid_bytes} B \
         after {MIDPOINT} (peak {peak_bytes} B = {:.3}x warm); final {final_size:?}, peak {peak_size:?}; universe \
         {universe_blocks} blocks, bound {max_holdings} holdings",
        churn_time.as_secs_f64(),
        EVENTS as f64 / churn_time.as_secs_f64(),
        final_bytes as f64 / warm_bytes as f64,
        final_bytes as f64 / mid_bytes as f64,
        peak_bytes as f64 / warm_bytes as f64,
    );

    for worker in 0..WORKERS {
        index.remove_worker(worker);
    }
    assert_eq!(index.size(), IndexSize::default());
    let emptied_bytes = live() - start_live;
    report!(
        report,
        "after removing every worker: size {:?}, live heap {emptied_bytes} B = {:.2}% of the peak, of which \
         {empty_bytes} B the empty index's own (heap_bytes() {} B)",
        index.size(),
        emptied_bytes as f64 * 100.0 / peak_bytes as f64,
        index.heap_bytes()
    );
    let tables_left = emptied_bytes - empty_bytes;
    assert!(
        tables_left * 16 <= peak_bytes - empty_bytes,
        "{tables_left} B of tables live after emptying the index, more than 1/16 of the {} B they peaked at",
        peak_bytes - empty_bytes
    );
    drop(index);
    let leaked = live() as isize - start_live as isize;
    report!(
        report,
        "after dropping the index: live heap {leaked} B relative to the start"
    );
    assert!(
        leaked.unsigned_abs() <= 4096,
        "{leaked} B not returned after dropping the index"
    );
}
