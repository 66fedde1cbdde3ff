//! A global allocator that counts live heap bytes, for tests and benchmarks that measure memory
//! (the KV index's soak test and bench). Linking this crate installs nothing: a program opts in
//! by declaring the allocator itself, then reads [`live`]:
//!
//! ```
//! use switchyard_harness::heap::{Counting, live};
//!
//! #[global_allocator]
//! static HEAP: Counting = Counting;
//!
//! fn main() {
//!     let before = live();
//!     let buffer = vec![0u8; 1 << 20];
//!     assert!(live() >= before + buffer.len());
//! }
//! ```
//!
//! It counts every thread's allocations, so a test binary that uses it runs that test alone.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes it holds.
#[derive(Debug)]
pub struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to `System` unchanged; only counts the bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        new
    }
}

/// Live heap bytes of this process, when its global allocator is [`Counting`] (else 0).
pub fn live() -> usize {
    LIVE.load(Ordering::SeqCst)
}
