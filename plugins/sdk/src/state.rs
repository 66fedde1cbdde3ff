//! State a policy keeps between calls of one instance (a record of its own decisions, say).
//!
//! The contract promises no state: the gateway may drop an instance and make a new one at any
//! time, and each of its threads calls its own instance. What a policy keeps here is therefore
//! a cache of what that instance has seen, never something it relies on. Natively (in tests,
//! which run in parallel) each thread has its own value.

/// A value kept in a `static` for the instance's lifetime, made by `init` at first use.
pub struct Kept<T> {
    #[cfg(target_arch = "wasm32")]
    cell: core::cell::UnsafeCell<Option<T>>,
    #[cfg(not(target_arch = "wasm32"))]
    per_thread: std::sync::Mutex<alloc::vec::Vec<(std::thread::ThreadId, T)>>,
}

// SAFETY: a component instance runs single-threaded, and `with` hands out the one `&mut`
// for the length of its closure only (which cannot reach `with` again: see there).
#[cfg(target_arch = "wasm32")]
unsafe impl<T> Sync for Kept<T> {}

impl<T> Kept<T> {
    /// Nothing kept yet.
    pub const fn new() -> Kept<T> {
        Kept {
            #[cfg(target_arch = "wasm32")]
            cell: core::cell::UnsafeCell::new(None),
            #[cfg(not(target_arch = "wasm32"))]
            per_thread: std::sync::Mutex::new(alloc::vec::Vec::new()),
        }
    }

    /// Runs `use_it` on the value, made by `init` the first time. `use_it` must not call
    /// `with` on the same `Kept` (it would panic natively and is undefined in a component).
    pub fn with<R>(&self, init: impl FnOnce() -> T, use_it: impl FnOnce(&mut T) -> R) -> R {
        #[cfg(target_arch = "wasm32")]
        {
            // SAFETY: single-threaded (see `Sync` above); the reference lives for this
            // block only and `use_it` does not re-enter (documented above).
            let value = unsafe { &mut *self.cell.get() };
            use_it(value.get_or_insert_with(init))
        }
        #[cfg(not(target_arch = "wasm32"))]
        {
            let mut kept = self
                .per_thread
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let me = std::thread::current().id();
            let slot = match kept.iter().position(|(thread, _)| *thread == me) {
                Some(slot) => slot,
                None => {
                    kept.push((me, init()));
                    kept.len() - 1
                }
            };
            use_it(&mut kept[slot].1)
        }
    }
}

impl<T> Default for Kept<T> {
    fn default() -> Kept<T> {
        Kept::new()
    }
}
