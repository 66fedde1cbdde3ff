//! A planner that passes the host's self-test and then misbehaves on live pools the way its
//! `mode` setting says: `loop` (never answers), `absurd` (asks for 4 billion workers),
//! `unknown-pool` (names a pool that does not exist), `twice` (two decisions for one pool),
//! `trap` (panics), `refuse` (answers an error). With no mode it asks for one more worker in
//! every pool below its maximum, as a well-behaved (if eager) planner.

#![no_std]

extern crate alloc;

use alloc::vec::Vec;

use hostile_common::sdk::{Planner, PolicyError, Pool, ScaleDecision};

struct Hostile;

fn decision(pool: u32, replicas: u32) -> ScaleDecision {
    ScaleDecision {
        pool,
        replicas,
        reason: "hostile".into(),
    }
}

impl Planner for Hostile {
    fn plan(pools: &[Pool], _max_gpus: u32) -> Result<Vec<ScaleDecision>, PolicyError> {
        let eager: Vec<ScaleDecision> = pools
            .iter()
            .enumerate()
            .filter(|(_, pool)| pool.desired < pool.max_workers)
            .map(|(index, pool)| decision(index as u32, pool.desired + 1))
            .collect();
        // The host's self-test pools (`synthetic_pools` in the gateway's `policy/planning.rs`).
        if pools.iter().any(|pool| pool.model == "self-test") {
            return Ok(eager);
        }
        match hostile_common::sdk::config::get("mode").as_deref() {
            Some("loop") => loop {
                core::hint::black_box(pools);
            },
            Some("absurd") => Ok(alloc::vec![decision(0, u32::MAX)]),
            Some("unknown-pool") => Ok(alloc::vec![decision(99, 1)]),
            Some("twice") => Ok(alloc::vec![decision(0, 2), decision(0, 3)]),
            Some("trap") => panic!("a planner that traps"),
            Some("refuse") => Err(PolicyError::new("a planner that refuses")),
            _ => Ok(eager),
        }
    }
}

hostile_common::sdk::planner!(Hostile);
