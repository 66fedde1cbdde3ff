//! Memory for the current call only.
//!
//! [`vec`] hands out a `Vec` from the same per-call arena the host's arguments are copied
//! into: taking it costs a pointer bump, dropping it costs nothing, and the whole arena is
//! reused by the next call. A policy that needs a buffer per worker (costs, ranks) uses it to
//! avoid the general allocator; one that outgrows the arena gets ordinary heap memory.

use alloc::vec::Vec;

/// An empty `Vec` with room for `capacity` values, valid until the current call returns.
///
/// It must not be kept past the call (in a `static`, say): the next call reuses its memory.
pub fn vec<T>(capacity: usize) -> Vec<T> {
    #[cfg(target_arch = "wasm32")]
    if let Ok(layout) = core::alloc::Layout::array::<T>(capacity)
        && layout.size() > 0
    {
        let block = crate::arena::bump(layout);
        if !block.is_null() {
            // SAFETY: `block` is `layout`'s size and alignment for `capacity` values of
            // `T`, and comes from the global allocator's arena, which that allocator
            // recognises on `dealloc` (a no-op) and on `realloc` (a copy out).
            return unsafe { Vec::from_raw_parts(block.cast::<T>(), 0, capacity) };
        }
    }
    Vec::with_capacity(capacity)
}
