//! What the gateway measured of its workers (its `measured` interface).

use alloc::vec::Vec;

pub use crate::router_world::switchyard::policy::measured::{PrefillFit, WorkerTiming};

/// Every LLM worker the gateway has measured: match them to the table's rows by the `ids`
/// column. Empty from a gateway that measured none yet (and in its validation call).
pub fn timings() -> Vec<WorkerTiming> {
    // Asked for as columns: the host copies a list of numbers in one go, where it stores a
    // list of records field by field (~15 ns a record, half of a 4,096-worker call).
    #[cfg(target_arch = "wasm32")]
    return {
        let columns = crate::router_world::switchyard::policy::measured::timing_columns();
        columns
            .ids
            .iter()
            .zip(&columns.itl_us)
            .zip(&columns.samples)
            .map(|((&id, &itl_us), &samples)| WorkerTiming { id, itl_us, samples })
            .collect()
    };
    #[cfg(not(target_arch = "wasm32"))]
    return crate::testing::timings();
}

/// Every LLM worker whose prefill the gateway has measured: a line from the prefill work a
/// request finds on the worker to its time to first token. Match them to the table's rows
/// by the `ids` column. Empty from a gateway that measured none yet (and in its validation
/// call).
pub fn prefill_fits() -> Vec<PrefillFit> {
    // As columns, as `timings` is.
    #[cfg(target_arch = "wasm32")]
    return {
        let columns = crate::router_world::switchyard::policy::measured::prefill_fit_columns();
        columns
            .ids
            .iter()
            .zip(&columns.fixed_ms)
            .zip(&columns.ms_per_ktoken)
            .zip(&columns.samples)
            .map(|(((&id, &fixed_ms), &ms_per_ktoken), &samples)| PrefillFit {
                id,
                fixed_ms,
                ms_per_ktoken,
                samples,
            })
            .collect()
    };
    #[cfg(not(target_arch = "wasm32"))]
    return crate::testing::prefill_fits();
}
