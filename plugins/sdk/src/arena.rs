//! Call arguments live in a bump arena that is reset when each exported call ends.
//!
//! The host copies every argument list into the guest through `cabi_realloc`; with a general
//! allocator each list costs a `malloc` and, when the call's arguments are dropped, a `free`.
//! Arguments are dead once the call returns, so they are bump-allocated instead, freeing is a
//! no-op, and the whole arena is reused by the next call ([`crate::scratch::vec`] hands out the same
//! memory). Everything else (and any argument that outgrows the arena) comes from dlmalloc. A
//! policy that keeps an argument beyond its call must clone it (moving a `Vec` argument into a
//! `static` would see it overwritten).
//!
//! The arena is a 12 KiB static (a table of ~380 workers with eight columns): with the 32 KiB
//! stack and the statics it stays in the low 64 KiB the gateway keeps resident between
//! instances, so a fresh instance's first calls neither page-fault nor grow its memory, which
//! dlmalloc's first allocation would.
//!
//! # Rejected designs
//!
//! - A 512 KiB arena, so that a 4,096-worker table's columns are bump-allocated too: 0–4 %
//!   faster at 1,024 and 4,096 workers (`least-load` 2.94 / 2.81 → 2.82 / 2.80 µs, `kv-aware`
//!   8.53 / 8.48 → 8.19 / 8.10 µs), since the copies, not the allocator, are where the columns'
//!   cost goes; and a static that large would sit past the low 64 KiB the gateway resets in
//!   place.

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicUsize, Ordering};

const SIZE: usize = 12 * 1024;

#[repr(C, align(16))]
struct Region(UnsafeCell<[u8; SIZE]>);

// SAFETY: a component instance runs single-threaded; the arena is only touched from the
// one thread that calls into it.
unsafe impl Sync for Region {}

static REGION: Region = Region(UnsafeCell::new([0; SIZE]));
static NEXT: AtomicUsize = AtomicUsize::new(0);

fn base() -> usize {
    REGION.0.get() as usize
}

/// Whether `pointer` was handed out by the arena.
pub(crate) fn contains(pointer: *mut u8) -> bool {
    let address = pointer as usize;
    address >= base() && address < base() + SIZE
}

/// A block from the arena, or null when it is full.
pub(crate) fn bump(layout: Layout) -> *mut u8 {
    let base = base();
    let start = (base + NEXT.load(Ordering::Relaxed)).next_multiple_of(layout.align());
    let end = start.saturating_add(layout.size());
    if end > base + SIZE {
        return core::ptr::null_mut();
    }
    NEXT.store(end - base, Ordering::Relaxed);
    start as *mut u8
}

/// Forgets every arena block (at the end of an exported call).
pub(crate) fn reset() {
    NEXT.store(0, Ordering::Relaxed);
}

/// dlmalloc, except that arena blocks are never freed individually.
pub(crate) struct PolicyAllocator;

// SAFETY: delegates to dlmalloc for every block it did not hand out from the arena, and
// never frees arena blocks; `realloc` of an arena block copies into a dlmalloc block.
unsafe impl GlobalAlloc for PolicyAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        unsafe { dlmalloc::GlobalDlmalloc.alloc(layout) }
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        if !contains(pointer) {
            // SAFETY: forwarded contract; the block came from dlmalloc.
            unsafe { dlmalloc::GlobalDlmalloc.dealloc(pointer, layout) }
        }
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !contains(pointer) {
            // SAFETY: forwarded contract; the block came from dlmalloc.
            return unsafe { dlmalloc::GlobalDlmalloc.realloc(pointer, layout, new_size) };
        }
        // SAFETY: `layout.align()` is a valid alignment and `new_size` is non-zero per the
        // `GlobalAlloc::realloc` contract.
        let moved = unsafe { self.alloc(Layout::from_size_align_unchecked(new_size, layout.align())) };
        if !moved.is_null() {
            // SAFETY: both blocks are valid for the copied length and do not overlap.
            unsafe { core::ptr::copy_nonoverlapping(pointer, moved, layout.size().min(new_size)) };
        }
        moved
    }
}

/// The component's allocator.
#[global_allocator]
static ALLOCATOR: PolicyAllocator = PolicyAllocator;
