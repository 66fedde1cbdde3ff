//! What a `no_std` component needs from its runtime: a panic handler that traps, and the
//! canonical ABI's `cabi_realloc`, which copies call arguments into the per-call arena where
//! they fit.

use crate::arena;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    core::arch::wasm32::unreachable()
}

/// The canonical ABI's allocation entry point, which the host calls to copy arguments in.
///
/// # Safety
///
/// Called by the component runtime with the canonical ABI's contract: `old_ptr`/`old_len`
/// describe a live allocation of alignment `align` (or are 0), and `new_len` is non-zero.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cabi_realloc(old_ptr: *mut u8, old_len: usize, align: usize, new_len: usize) -> *mut u8 {
    use alloc::alloc::{Layout, alloc, realloc};
    // SAFETY: the canonical ABI passes a power-of-two alignment and, for a reallocation, the
    // layout the block was allocated with.
    let pointer = unsafe {
        if old_len == 0 {
            if new_len == 0 {
                return align as *mut u8;
            }
            let layout = Layout::from_size_align_unchecked(new_len, align);
            let block = arena::bump(layout);
            if block.is_null() { alloc(layout) } else { block }
        } else {
            realloc(old_ptr, Layout::from_size_align_unchecked(old_len, align), new_len)
        }
    };
    if pointer.is_null() {
        core::arch::wasm32::unreachable();
    }
    pointer
}
