//! A policy to copy: send a request where most of its prompt is cached, unless that worker is
//! already `slack` requests busier than the least busy one (then take the least busy).
//!
//! Copy this folder, rename the package, add it to `plugins/Cargo.toml`, then:
//! `cargo test -p NAME --lib` (offline, natively), `cargo build --release --target
//! wasm32-wasip2 -p NAME`, and `switchyard policy push NAME target/wasm32-wasip2/release/NAME.wasm
//! --activate --admin URL --token TOKEN`.

#![cfg_attr(not(test), no_std)]

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable, config};

/// The policy.
pub struct PrefixAffinity;

impl Router for PrefixAffinity {
    // The columns `route` reads: the host sends only what policies ask for, so each call is
    // cheaper than with every column (the default). A column left out reads as empty.
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::ACTIVE_REQUESTS)
        .union(Columns::OVERLAP_DEVICE_BLOCKS);

    fn route(_req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        let slack = config::get_f64("slack", 4.0) as u32;
        let least_busy = workers
            .llm_indices()
            .min_by_key(|&i| workers.active_requests[i])
            .ok_or_else(|| PolicyError::new("no LLM worker in the table"))?;
        let floor = workers.active_requests[least_busy];
        let best_cached = workers
            .llm_indices()
            .filter(|&i| workers.active_requests[i] <= floor.saturating_add(slack))
            .max_by_key(|&i| {
                (
                    workers.overlap_device_blocks[i],
                    core::cmp::Reverse(workers.active_requests[i]),
                )
            })
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
