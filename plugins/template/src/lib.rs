//! A policy to copy: send a request where most of its prompt is cached, unless that worker is
//! already `slack` requests busier than the least busy one (then take the least busy).
//!
//! This folder is a package of its own (its own `[workspace]`, `Cargo.lock`, release profile
//! and `.cargo/config.toml`), so it builds wherever it is copied:
//!
//! 1. Copy the folder anywhere and rename the package in `Cargo.toml`.
//! 2. Point the `switchyard-policy-sdk` dependency at the SDK: a git dependency on the
//!    Switchyard repository, or a path to a checkout's `plugins/sdk`.
//! 3. Test it natively, offline: `cargo test --lib`.
//! 4. Build the component: `cargo build --release --target wasm32-wasip2`. Cargo names the
//!    file after the package with `-` changed to `_`: this one is
//!    `target/wasm32-wasip2/release/policy_template.wasm`.
//! 5. Check it as the gateway would: `switchyard policy check
//!    target/wasm32-wasip2/release/NAME_WITH_UNDERSCORES.wasm [--config policy.toml]`.
//! 6. Push it: `switchyard policy push NAME target/wasm32-wasip2/release/NAME_WITH_UNDERSCORES.wasm
//!    --activate --admin URL --token TOKEN`.

#![cfg_attr(not(test), no_std)]

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, config, role};

/// The policy.
pub struct PrefixAffinity;

impl Router for PrefixAffinity {
    // The columns `route` reads: the host sends only what policies ask for, so each call is
    // cheaper than with every column (the default).
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::ACTIVE_REQUESTS)
        .union(Columns::OVERLAP_DEVICE_BLOCKS);

    fn route(_req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let slack = config::get_f64("slack", 4.0) as u32;
        // Checked reads, once per call: a column missing from `COLUMNS` answers an error that
        // names it (shown by `switchyard policy check` and in the gateway's log), where
        // indexing the raw field (`workers.active_requests[i]`, the unchecked fast path) would
        // trap without saying why.
        let roles = workers.roles()?;
        let active = workers.active_requests()?;
        let cached = workers.overlap_device_blocks()?;
        let llm = || (0..workers.len()).filter(|&i| roles[i] == role::LLM);
        let least_busy = llm()
            .min_by_key(|&i| active[i])
            .ok_or_else(|| PolicyError::new("no LLM worker in the table"))?;
        let floor = active[least_busy];
        let best_cached = llm()
            .filter(|&i| active[i] <= floor.saturating_add(slack))
            .max_by_key(|&i| (cached[i], core::cmp::Reverse(active[i])))
            .unwrap_or(least_busy);
        Ok(Decision::to(best_cached))
    }
}

switchyard_policy_sdk::router!(PrefixAffinity);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::testing;

    #[test]
    fn follows_the_cache_while_load_allows() {
        let mut table = testing::table(3);
        table.overlap_device_blocks = vec![0, 12, 3];
        table.active_requests = vec![1, 3, 0];
        let decision = testing::route::<PrefixAffinity>(&testing::request(1, 1024), &table).expect("a decision");
        assert_eq!(decision.worker, 1);
    }

    #[test]
    fn leaves_the_cache_when_it_is_too_busy() {
        testing::set_config("slack", "2");
        let mut table = testing::table(3);
        table.overlap_device_blocks = vec![0, 12, 3];
        table.active_requests = vec![1, 9, 0];
        let decision = testing::route::<PrefixAffinity>(&testing::request(1, 1024), &table).expect("a decision");
        assert_eq!(decision.worker, 2, "worker 1 is 9 busy, floor 0 + slack 2");
    }
}
