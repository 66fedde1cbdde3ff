//! The prompt of the request being routed, for routers that keep their own record of where
//! prompts went (an approximate prefix index) instead of reading the overlap columns.

use alloc::vec::Vec;

/// The sequence hashes of the prompt's full KV blocks, in order: hash `i` covers the first
/// `i + 1` blocks, so two prompts share their first `k` hashes exactly when they share
/// their first `k` blocks. Empty outside a `route` call. Copied from the host each call:
/// read it once.
pub fn block_hashes() -> Vec<u64> {
    #[cfg(target_arch = "wasm32")]
    return crate::router_world::switchyard::policy::prompt::block_hashes();
    #[cfg(not(target_arch = "wasm32"))]
    return crate::testing::prompt();
}
