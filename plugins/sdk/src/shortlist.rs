//! Shortlists: the few workers whose exact cost a router has to compute.
//!
//! A router over thousands of workers spends its time computing a cost per worker in `f64`,
//! one worker at a time. The fast way keeps that exact formula for the decision but runs it only
//! on a shortlist: first an `f32` estimate of every worker's cost, in a loop the compiler turns
//! into Wasm SIMD (four workers per instruction), with a bound on how far the estimate can be
//! from the exact cost; then the exact formula on the workers whose estimate is within twice
//! that bound of the least. Every worker the exact formula would pick (or tie) is on the list,
//! so the decision is the exact formula's, bit for bit; the rest only ever lose.
//!
//! This module holds the scans over the estimates; a router writes its own estimate loop. The
//! scans are four lanes wide in a component (LLVM does not vectorize float reductions for Wasm
//! by itself) and scalar elsewhere: natively (in tests) they are the reference.

use alloc::vec::Vec;

/// The least value of `keys`, `+∞` when it is empty. `keys` must hold no NaN.
pub fn least(keys: &[f32]) -> f32 {
    scan::least(keys)
}

/// The three least values of `keys`, ascending, padded with `+∞`. `keys` must hold no NaN.
pub fn least_three(keys: &[f32]) -> [f32; 3] {
    scan::least_three(keys)
}

/// The indices of the keys at most `limit`, ascending, in the call's scratch memory.
pub fn at_most(keys: &[f32], limit: f32) -> Vec<u32> {
    let mut out = crate::scratch::vec(16);
    scan::at_most(keys, limit, &mut out);
    out
}

/// The indices of the `f64` keys at most `limit`, ascending, in the call's scratch memory.
pub fn at_most_f64(keys: &[f64], limit: f64) -> Vec<u32> {
    use crate::lanes::F64x2;
    let mut out = crate::scratch::vec(16);
    let (pairs, tail) = keys.as_chunks::<2>();
    let bound = F64x2::splat(limit);
    for (chunk, pair) in pairs.iter().enumerate() {
        // Most pairs hold no candidate: one test skips them.
        if F64x2::load(pair).le(bound).any() {
            for (lane, key) in pair.iter().enumerate() {
                if *key <= limit {
                    out.push((chunk * 2 + lane) as u32);
                }
            }
        }
    }
    if let Some(key) = tail.first()
        && *key <= limit
    {
        out.push((pairs.len() * 2) as u32);
    }
    out
}

/// Three least values of each lane of `keys` so far, kept in order by a min/max network, for a
/// router's estimate loop: [`Least3::take`] each pair of estimates, then [`Least3::finish`].
#[derive(Clone, Copy, Debug)]
pub struct Least3 {
    first: crate::lanes::F64x2,
    second: crate::lanes::F64x2,
    third: crate::lanes::F64x2,
}

impl Least3 {
    /// Nothing seen: every lane `+∞`.
    pub fn new() -> Least3 {
        let infinite = crate::lanes::F64x2::splat(f64::INFINITY);
        Least3 {
            first: infinite,
            second: infinite,
            third: infinite,
        }
    }

    /// Takes two keys in (no NaN).
    #[inline(always)]
    pub fn take(&mut self, keys: crate::lanes::F64x2) {
        let carry = self.first.max(keys);
        self.first = keys.min(self.first);
        let carry2 = self.second.max(carry);
        self.second = carry.min(self.second);
        self.third = carry2.min(self.third);
    }

    /// The three least keys taken, ascending, padded with `+∞`.
    pub fn finish(&self) -> [f64; 3] {
        let mut best = [f64::INFINITY; 3];
        for lanes in [self.first, self.second, self.third] {
            let mut pair = [0.0; 2];
            lanes.store(&mut pair);
            for key in pair {
                if key < best[2] {
                    best[2] = key;
                    if key < best[1] {
                        best.swap(1, 2);
                        if key < best[0] {
                            best.swap(0, 1);
                        }
                    }
                }
            }
        }
        best
    }
}

impl Default for Least3 {
    fn default() -> Least3 {
        Least3::new()
    }
}

/// Scalar scans: what runs natively, and the reference for the SIMD ones.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod scan {
    use alloc::vec::Vec;

    pub fn least(keys: &[f32]) -> f32 {
        keys.iter()
            .copied()
            .fold(f32::INFINITY, |a, b| if b < a { b } else { a })
    }

    pub fn least_three(keys: &[f32]) -> [f32; 3] {
        let mut best = [f32::INFINITY; 3];
        for &key in keys {
            insert(&mut best, key);
        }
        best
    }

    /// Puts `key` into the ascending `best` if it belongs there.
    pub fn insert(best: &mut [f32; 3], key: f32) {
        if key < best[2] {
            best[2] = key;
            if key < best[1] {
                best.swap(1, 2);
                if key < best[0] {
                    best.swap(0, 1);
                }
            }
        }
    }

    pub fn at_most(keys: &[f32], limit: f32, out: &mut Vec<u32>) {
        out.extend(
            keys.iter()
                .enumerate()
                .filter(|(_, key)| **key <= limit)
                .map(|(index, _)| index as u32),
        );
    }
}

/// The same scans, four keys per instruction.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod scan {
    use alloc::vec::Vec;
    use core::arch::wasm32::{
        f32x4_extract_lane, f32x4_le, f32x4_pmax, f32x4_pmin, f32x4_splat, v128, v128_any_true, v128_load,
    };

    /// Four keys as one vector.
    fn load(lanes: &[f32; 4]) -> v128 {
        // SAFETY: `lanes` is 16 readable bytes, and Wasm vector loads need no alignment.
        unsafe { v128_load(lanes.as_ptr().cast()) }
    }

    fn lanes(v: v128) -> [f32; 4] {
        [
            f32x4_extract_lane::<0>(v),
            f32x4_extract_lane::<1>(v),
            f32x4_extract_lane::<2>(v),
            f32x4_extract_lane::<3>(v),
        ]
    }

    fn insert(best: &mut [f32; 3], key: f32) {
        if key < best[2] {
            best[2] = key;
            if key < best[1] {
                best.swap(1, 2);
                if key < best[0] {
                    best.swap(0, 1);
                }
            }
        }
    }

    pub fn least(keys: &[f32]) -> f32 {
        let (quads, tail) = keys.as_chunks::<4>();
        // `pmin` is one instruction; `min` (NaN- and signed-zero-exact) is a sequence, and in
        // this loop-carried chain it made the scan ~4× slower. Keys hold no NaN.
        let mut least = f32x4_splat(f32::INFINITY);
        for quad in quads {
            least = f32x4_pmin(load(quad), least);
        }
        lanes(least)
            .into_iter()
            .chain(tail.iter().copied())
            .fold(f32::INFINITY, |a, b| if b < a { b } else { a })
    }

    pub fn least_three(keys: &[f32]) -> [f32; 3] {
        let (quads, tail) = keys.as_chunks::<4>();
        // Per lane, the three least seen in that lane, kept sorted by a min/max network.
        let mut first = f32x4_splat(f32::INFINITY);
        let mut second = first;
        let mut third = first;
        for quad in quads {
            let key = load(quad);
            let carry = f32x4_pmax(first, key);
            first = f32x4_pmin(key, first);
            let carry2 = f32x4_pmax(second, carry);
            second = f32x4_pmin(carry, second);
            third = f32x4_pmin(carry2, third);
        }
        let mut best = [f32::INFINITY; 3];
        for key in lanes(first)
            .into_iter()
            .chain(lanes(second))
            .chain(lanes(third))
            .chain(tail.iter().copied())
        {
            insert(&mut best, key);
        }
        best
    }

    pub fn at_most(keys: &[f32], limit: f32, out: &mut Vec<u32>) {
        let (quads, tail) = keys.as_chunks::<4>();
        let bound = f32x4_splat(limit);
        for (chunk, quad) in quads.iter().enumerate() {
            // Most quads hold no candidate: one test skips them.
            if v128_any_true(f32x4_le(load(quad), bound)) {
                for (lane, key) in quad.iter().enumerate() {
                    if *key <= limit {
                        out.push((chunk * 4 + lane) as u32);
                    }
                }
            }
        }
        let start = quads.len() * 4;
        for (offset, key) in tail.iter().enumerate() {
            if *key <= limit {
                out.push((start + offset) as u32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_find_the_least_keys_and_those_under_a_limit() {
        let keys = [5.0, 3.0, f32::INFINITY, 9.0, 3.0, 1.0, 7.0];
        assert_eq!(least(&keys), 1.0);
        assert_eq!(least_three(&keys), [1.0, 3.0, 3.0]);
        assert_eq!(at_most(&keys, 3.0), [1, 4, 5]);
        assert_eq!(least(&[]), f32::INFINITY);
        assert_eq!(least_three(&[2.0]), [2.0, f32::INFINITY, f32::INFINITY]);
        assert!(at_most(&keys, 0.5).is_empty());
        let wide = [5.0, 3.0, f64::INFINITY, 9.0, 3.0, 1.0, 7.0];
        assert_eq!(at_most_f64(&wide, 3.0), [1, 4, 5]);
        assert_eq!(at_most_f64(&wide, 7.0), [0, 1, 4, 5, 6]);
        let mut least = Least3::new();
        for pair in wide.as_chunks::<2>().0 {
            least.take(crate::lanes::F64x2::load(pair));
        }
        assert_eq!(least.finish(), [1.0, 3.0, 3.0]);
    }
}
