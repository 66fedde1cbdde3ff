//! Hostile guest `huge-return`: returns 65,536 fallbacks (256 KiB) for a table of a few workers on live traffic.

#![no_std]

extern crate alloc;

#[allow(unused_imports)]
use alloc::vec;
use switchyard_policy_sdk::{Decision, PolicyError, RequestInfo, Router, WorkerTable};

struct Hostile;

/// The host's self-test uses a 1024-token synthetic request; live traffic does not.
fn live(req: &RequestInfo) -> bool {
    req.prompt_tokens != 1024
}

impl Router for Hostile {
    fn route(req: &RequestInfo, _workers: &WorkerTable) -> Result<Decision, PolicyError> {
        if live(req) {
            return Ok(Decision {
                worker: 0,
                encoder: None,
                fallbacks: vec![0; 1 << 16],
            });
        }
        Ok(Decision::to(0))
    }
}

switchyard_policy_sdk::router!(Hostile);
