//! What the pool has measured of its workers, as the policies' `measured` import answers it.
//!
//! Each LLM worker keeps its own measurements (the typical gap between the chunks of its
//! streams, and a line fitted to how long the prefill work it found took); this module turns
//! the pool's into the contract's records, so the policy runtime reads them through
//! [`TimingSource`] without knowing the pool.

use crate::policy::host::{PrefillFit, WorkerTiming};
use crate::policy::runtime::TimingSource;
use crate::workers::WorkerPool;

impl TimingSource for WorkerPool {
    /// Every LLM worker measured so far.
    fn timings(&self) -> Vec<WorkerTiming> {
        self.workers()
            .iter()
            .filter(|worker| worker.role.generates())
            .filter_map(|worker| {
                let (itl_us, samples) = worker.measured_itl();
                (samples > 0).then_some(WorkerTiming {
                    id: worker.kv_id,
                    itl_us,
                    samples,
                })
            })
            .collect()
    }

    /// Every LLM worker with a fitted prefill line.
    fn prefill_fits(&self) -> Vec<PrefillFit> {
        self.workers()
            .iter()
            .filter(|worker| worker.role.generates())
            .filter_map(|worker| {
                let line = worker.measured_prefill().0?;
                Some(PrefillFit {
                    id: worker.kv_id,
                    fixed_ms: line.fixed_ms as f32,
                    ms_per_ktoken: (line.ms_per_token * 1000.0) as f32,
                    samples: line.samples,
                })
            })
            .collect()
    }
}
