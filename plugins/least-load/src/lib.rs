//! `least-load`: the LLM worker with the fewest active requests; ties go to the one with the
//! fewest prefill tokens in flight, then the lowest index.

#![cfg_attr(not(test), no_std)]

use switchyard_policy_sdk::{Columns, Decision, PolicyError, RequestInfo, Router, WorkerTable};

/// The policy.
pub struct LeastLoad;

impl Router for LeastLoad {
    const COLUMNS: Columns = Columns::ROLES
        .union(Columns::ACTIVE_REQUESTS)
        .union(Columns::PREFILL_TOKENS);

    fn route(_req: &RequestInfo, workers: &WorkerTable) -> Result<Decision, PolicyError> {
        least_load(workers.roles, workers.active_requests, workers.prefill_tokens)
            .map(Decision::to)
            .ok_or_else(|| PolicyError::new("no LLM worker in the table"))
    }
}

/// The index of the least-loaded LLM worker.
///
/// Two passes: the least `(active, prefill)` pair among LLM workers, then the first worker
/// holding it. Both are branch-free over the workers and, in a component, run four workers per
/// Wasm SIMD instruction (LLVM does not vectorize these scans for Wasm by itself), which keeps
/// a decision over thousands of workers within a few microseconds.
pub fn least_load(roles: &[u32], active: &[u32], prefill: &[u32]) -> Option<usize> {
    let n = roles.len().min(active.len()).min(prefill.len());
    let (roles, active, prefill) = (&roles[..n], &active[..n], &prefill[..n]);
    let least = scan::least(roles, active, prefill);
    scan::first(roles, active, prefill, least)
}

/// Scalar scans: what runs natively (in tests), and the reference for the SIMD ones.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod scan {
    use switchyard_policy_sdk::role;

    /// The least `(active, prefill)` pair over LLM workers; `(u32::MAX, u32::MAX)` when none.
    pub fn least(roles: &[u32], active: &[u32], prefill: &[u32]) -> (u32, u32) {
        let mut least = (u32::MAX, u32::MAX);
        for ((&role, &active), &prefill) in roles.iter().zip(active).zip(prefill) {
            if role == role::LLM {
                least = least.min((active, prefill));
            }
        }
        least
    }

    /// The first LLM worker whose `(active, prefill)` pair is `wanted`.
    pub fn first(roles: &[u32], active: &[u32], prefill: &[u32], wanted: (u32, u32)) -> Option<usize> {
        (0..roles.len()).find(|&i| roles[i] == role::LLM && (active[i], prefill[i]) == wanted)
    }
}

/// The same scans, four workers per instruction.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod scan {
    use core::arch::wasm32::{
        u32x4_eq, u32x4_extract_lane, u32x4_lt, u32x4_min, u32x4_ne, u32x4_splat, v128, v128_and, v128_any_true,
        v128_bitselect, v128_load, v128_or,
    };

    use switchyard_policy_sdk::role;

    /// Four values as one vector.
    fn load(lanes: &[u32; 4]) -> v128 {
        // SAFETY: `lanes` is 16 readable bytes, and Wasm vector loads need no alignment.
        unsafe { v128_load(lanes.as_ptr().cast()) }
    }

    /// `values` four at a time (the tail that does not fill four left out).
    fn quads(values: &[u32]) -> &[[u32; 4]] {
        values.as_chunks::<4>().0
    }

    /// The running least pair, lane by lane.
    #[derive(Clone, Copy)]
    struct Least {
        active: v128,
        prefill: v128,
    }

    impl Least {
        fn none() -> Least {
            Least {
                active: u32x4_splat(u32::MAX),
                prefill: u32x4_splat(u32::MAX),
            }
        }

        /// Takes four workers in.
        #[inline(always)]
        fn update(&mut self, roles: &[u32; 4], active: &[u32; 4], prefill: &[u32; 4]) {
            // All ones in the lanes of other workers: OR-ed in, they make the pair (MAX, MAX).
            let other = u32x4_ne(load(roles), u32x4_splat(role::LLM));
            let active = v128_or(load(active), other);
            let prefill = v128_or(load(prefill), other);
            let fewer = u32x4_lt(active, self.active);
            let same = u32x4_eq(active, self.active);
            let tied_prefill = v128_bitselect(u32x4_min(self.prefill, prefill), self.prefill, same);
            self.prefill = v128_bitselect(prefill, tied_prefill, fewer);
            self.active = u32x4_min(self.active, active);
        }

        /// The least pair over the lanes.
        fn reduce(&self) -> (u32, u32) {
            [
                (
                    u32x4_extract_lane::<0>(self.active),
                    u32x4_extract_lane::<0>(self.prefill),
                ),
                (
                    u32x4_extract_lane::<1>(self.active),
                    u32x4_extract_lane::<1>(self.prefill),
                ),
                (
                    u32x4_extract_lane::<2>(self.active),
                    u32x4_extract_lane::<2>(self.prefill),
                ),
                (
                    u32x4_extract_lane::<3>(self.active),
                    u32x4_extract_lane::<3>(self.prefill),
                ),
            ]
            .into_iter()
            .fold((u32::MAX, u32::MAX), Ord::min)
        }
    }

    /// See the scalar version. Eight workers per round, in two independent running minima so
    /// that one round need not wait for the previous one's result.
    pub fn least(roles: &[u32], active: &[u32], prefill: &[u32]) -> (u32, u32) {
        let (mut even, mut odd) = (Least::none(), Least::none());
        let eights = |values| quads(values).as_chunks::<2>().0;
        for (([roles_a, roles_b], [active_a, active_b]), [prefill_a, prefill_b]) in
            eights(roles).iter().zip(eights(active)).zip(eights(prefill))
        {
            even.update(roles_a, active_a, prefill_a);
            odd.update(roles_b, active_b, prefill_b);
        }
        let mut least = even.reduce().min(odd.reduce());
        let whole = roles.len() - roles.len() % 8;
        for i in whole..roles.len() {
            if roles[i] == role::LLM {
                least = least.min((active[i], prefill[i]));
            }
        }
        least
    }

    /// See the scalar version.
    pub fn first(roles: &[u32], active: &[u32], prefill: &[u32], wanted: (u32, u32)) -> Option<usize> {
        let (llm, wanted_active, wanted_prefill) =
            (u32x4_splat(role::LLM), u32x4_splat(wanted.0), u32x4_splat(wanted.1));
        let matches = |i: usize| roles[i] == role::LLM && (active[i], prefill[i]) == wanted;
        let chunks = quads(roles).iter().zip(quads(active)).zip(quads(prefill));
        for (chunk, ((roles, active), prefill)) in chunks.enumerate() {
            let hit = v128_and(
                u32x4_eq(load(roles), llm),
                v128_and(
                    u32x4_eq(load(active), wanted_active),
                    u32x4_eq(load(prefill), wanted_prefill),
                ),
            );
            if v128_any_true(hit) {
                return (chunk * 4..chunk * 4 + 4).find(|&i| matches(i));
            }
        }
        let whole = roles.len() - roles.len() % 4;
        (whole..roles.len()).find(|&i| matches(i))
    }
}

switchyard_policy_sdk::router!(LeastLoad);

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy_sdk::testing;

    #[test]
    fn fewest_requests_then_least_prefill_then_lowest_index() {
        let mut table = testing::table(5);
        table.roles = vec![0, 1, 0, 0, 0];
        table.active_requests = vec![3, 0, 2, 2, 2];
        table.prefill_tokens = vec![0, 0, 500, 100, 100];
        let decision = testing::route::<LeastLoad>(&testing::request(1, 64), &table).expect("a decision");
        assert_eq!(decision.worker, 3, "worker 1 is an encoder; 3 and 4 tie, 3 comes first");
    }

    #[test]
    fn saturated_counts_are_still_workers() {
        let mut table = testing::table(2);
        table.roles = vec![1, 0];
        table.active_requests = vec![0, u32::MAX];
        table.prefill_tokens = vec![0, u32::MAX];
        let decision = testing::route::<LeastLoad>(&testing::request(1, 64), &table).expect("a decision");
        assert_eq!(decision.worker, 1);
    }

    #[test]
    fn no_llm_worker_is_an_error() {
        let mut table = testing::table(2);
        table.roles = vec![1, 2];
        assert!(testing::route::<LeastLoad>(&testing::request(1, 64), &table).is_err());
        assert!(testing::route::<LeastLoad>(&testing::request(1, 64), &testing::table(0)).is_err());
    }
}
