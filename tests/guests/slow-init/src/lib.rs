//! Hostile guest `slow-init`: `init` never returns, so the host must refuse it at load.

#![no_std]

use switchyard_policy_sdk::{Decision, PolicyError, RequestInfo, Router, WorkerTable};

struct Hostile;

impl Router for Hostile {
    fn init() -> Result<(), PolicyError> {
        #[allow(clippy::empty_loop)]
        loop {
            core::hint::black_box(0);
        }
    }

    fn route(_req: &RequestInfo, _workers: &WorkerTable) -> Result<Decision, PolicyError> {
        Ok(Decision::to(0))
    }
}

switchyard_policy_sdk::router!(Hostile);
